"""`k3 eval lm`: lm-evaluation-harness against a `k3 serve` subprocess.

The checkpoint is served as a user serves it (`python -m k3.cli serve CKPT` on a free loopback port, in its own
process group), lm-eval's `local-completions` model talks to it (string prompts, the server's /tokenize and
/detokenize as the tokenizer), and the server is stopped on every way out: success, an error, Ctrl-C, SIGTERM.
Needs the `eval` extra (`pip install -e '.[eval]'`).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

INSTALL_HINT = "pip install -e '.[eval]'"


class LmEvalError(RuntimeError):
    """A problem `k3 eval lm` reports as one line: lm-eval missing, an unknown task, a server that did not start."""


def require_lm_eval():
    """The lm_eval module, or LmEvalError naming the extra to install (lm-eval's API models need its `api` extra
    too: aiohttp, tenacity, requests)."""
    try:
        import lm_eval
    except ImportError:
        raise LmEvalError(f"lm-evaluation-harness is not installed; install k3's `eval` extra: {INSTALL_HINT}") \
            from None
    missing = [m for m in ("aiohttp", "tenacity", "requests", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        raise LmEvalError(f"lm-eval's API models need {', '.join(missing)}; install k3's `eval` extra: "
                          f"{INSTALL_HINT}")
    return lm_eval


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it drains and exits), SIGKILL if it is still there after 30 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _sigterm_as_interrupt(*_args) -> None:
    raise KeyboardInterrupt  # so that a `kill` of this process also runs the finally that stops the server


@contextlib.contextmanager
def served(ckpt: Path, *, port: int = 0, device: str = "auto", dtype: str = "auto", max_model_len: int = 2048,
           max_batch: int = 16, extra_args: Sequence[str] = (), startup_timeout_s: float = 900,
           log=None) -> Iterator[tuple[str, str]]:
    """Run `k3 serve CKPT` on 127.0.0.1:PORT (0 = a free port) until the block exits; yields (base URL, served model
    name) once /health answers 200 (weights loaded, engine warmed). A server that exits or stays unhealthy raises
    LmEvalError with the tail of its log."""
    import httpx

    port = port or free_port()
    cmd = [sys.executable, "-m", "k3.cli", "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
           "--device", device, "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-batch",
           str(max_batch), *extra_args]
    # the log goes to a file: a pipe nobody reads could fill and block the server
    log_file = tempfile.NamedTemporaryFile("w+", prefix="k3-eval-lm-", suffix=".serve.log", delete=False)  # noqa: SIM115
    # its own session: a terminal's Ctrl-C reaches this process only, which then stops the server's whole group
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        log_file.flush()
        text = Path(log_file.name).read_text(errors="replace").strip()
        return "\n".join(text.splitlines()[-25:]) or "(no output)"

    previous = signal.getsignal(signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()  # signal handlers: the main thread only
    if in_main:
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise LmEvalError(f"k3 serve exited with code {proc.returncode} before it was ready; its log "
                                  f"({log_file.name}) ends:\n{tail()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise LmEvalError(f"k3 serve was not healthy within {startup_timeout_s:.0f} s; its log "
                                  f"({log_file.name}) ends:\n{tail()}")
            time.sleep(0.2)
        name = httpx.get(url + "/v1/models", timeout=10).raise_for_status().json()["data"][0]["id"]
        if log is not None:
            log(f"k3 serve {ckpt} is up at {url} as {name!r} (pid {proc.pid})")
        yield url, name
    finally:
        _stop(proc)
        log_file.close()
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        if proc.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
            Path(log_file.name).unlink(missing_ok=True)  # kept when the server failed: the error names it


def check_tasks(task_manager, tasks: Sequence[str]) -> None:
    """Every requested task (or group, or tag) is one lm-eval knows, before a server starts for nothing."""
    known = set(task_manager.all_tasks)
    for t in tasks:
        if t not in known:
            close = difflib.get_close_matches(t, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise LmEvalError(f"unknown lm-eval task {t!r}{hint} (local tasks: pass the folder of their YAML "
                              "files with --include-path; `lm_eval ls tasks` lists the built-in ones)")


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def results_table(results: dict):
    """A rich Table: one row per task and metric (value, standard error, documents)."""
    from rich.table import Table

    table = Table(title="lm-eval results")
    for col, just in (("task", "left"), ("metric", "left"), ("filter", "left"), ("value", "right"),
                      ("stderr", "right"), ("n", "right")):
        table.add_column(col, justify=just)
    n_samples = results.get("n-samples", {})
    for task, metrics in results.get("results", {}).items():
        n = n_samples.get(task, {}).get("effective", "")
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            err = metrics.get(f"{metric}_stderr,{filt}")
            table.add_row(task, metric, filt, _fmt(value), "" if err in (None, "N/A") else _fmt(err), str(n))
    return table


def _json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
    except ImportError:
        pass
    return str(o)  # dtypes, functions in task configs: their text, as lm-eval's own output does


def run_lm_eval(ckpt: str | Path, tasks: Sequence[str], *, include_path: str | Path | None = None,
                limit: float | None = None, num_fewshot: int | None = None, batch_size: int = 1,
                device: str = "auto", dtype: str = "auto", port: int = 0, max_model_len: int = 2048,
                output: str | Path | None = None, log_samples: bool = False, seed: int = 0,
                serve_args: Sequence[str] = (), console=None) -> dict:
    """Serve CKPT, run lm_eval.simple_evaluate with `local-completions` on `tasks`, stop the server; prints the
    results table and returns lm-eval's results dict (with per-document `samples` when log_samples). `output`:
    where that dict goes as JSON. Local task YAML files: `include_path`; lm-eval reads a task's relative
    `data_files` from the working directory."""
    from rich.console import Console

    from k3.model.checkpoint import read_release_config

    console = console or Console()
    ckpt = Path(ckpt).expanduser()
    read_release_config(ckpt)  # CheckpointError naming the problem, before lm-eval loads or a server starts
    tasks = [t.strip() for t in tasks if t.strip()]
    if not tasks:
        raise LmEvalError("give at least one task, e.g. --tasks hellaswag,arc_easy")
    if include_path is not None and not Path(include_path).is_dir():
        raise LmEvalError(f"--include-path {include_path}: not a directory (the folder holding the task YAML files)")
    if limit is not None and limit >= 1:
        limit = int(limit)  # lm-eval reads a float as a fraction only below 1; an int reads as a count in its JSON
    out_path = Path(output).expanduser().resolve() if output is not None else None
    lm_eval = require_lm_eval()
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-request INFO lines would bury the table
    task_manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    check_tasks(task_manager, tasks)
    with served(ckpt.resolve(), port=port, device=device, dtype=dtype, max_model_len=max_model_len,
                max_batch=max(16, batch_size), extra_args=serve_args, log=lambda m: console.print(m, markup=False, highlight=False)) as (url, name):
        model_args = {"model": name, "base_url": f"{url}/v1/completions", "tokenizer_backend": "remote",
                      "tokenized_requests": False, "max_length": max_model_len, "max_retries": 1, "timeout": 600}
        results = lm_eval.simple_evaluate(
            model="local-completions", model_args=model_args, tasks=list(tasks), task_manager=task_manager,
            num_fewshot=num_fewshot, limit=limit, batch_size=batch_size, log_samples=log_samples,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    if results is None:
        raise LmEvalError("lm-eval returned no results")
    console.print(results_table(results))
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=2, default=_json_default, ensure_ascii=False) + "\n")
        console.print(f"results: {out_path}")
    return results
