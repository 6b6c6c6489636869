"""Host (Python) overhead of k3's serving engine per decode step and per generated token, without and with HTTP.

    python benchmarks/serve_host.py [--device cpu] [--model k3-debug] [--batch 32] [--new-tokens 128] [--http]
    python benchmarks/serve_host.py --http --profile          # + yappi: host µs per token by function and thread
    python benchmarks/serve_host.py --device cuda --model k3-small --http   # on a GPU (decode replays CUDA graphs)

A release with random weights at `--model`'s sizes (a small BPE trained here, as benchmarks/serve.py does) is
served as `k3 serve` serves it (k3.serve.server.load_state: warm-up, CUDA graphs on a GPU, prefix caching on, the
start-up heap frozen); `--batch` greedy requests of `--prompt-len` random tokens, `--new-tokens` each, ignore_eos,
all prompts prefilled in one step so the sequences decode in lockstep. Only the decode steps that run all `--batch`
sequences (one token each) are counted, after an untimed pass of the same workload (graph captures, lazy set-up).
Columns (medians over the counted steps unless noted):
- engine step ms: wall time of `Engine.step` (scheduling, host inputs, the forward, sampling readback, stop
  checks, detokenization, metrics, the sinks);
- model ms: wall time of `ModelRunner.step` inside it (the forward; on CUDA synchronised, so the GPU's time counts
  here, not in the host part);
- host ms, host µs/token: engine step - model, per step and per generated token (wall clock: with --http this
  includes waiting for the GIL while the event loop runs);
- host CPU µs/token: the same from the engine thread's CPU clock (mean; waiting for the GIL or a core excluded, the
  Python work itself);
- out tok/s: tokens / step (engine alone) or tokens / step period (--http);
- GC pauses: the garbage collections during the counted steps (count, total and longest, any thread);
- snapshot steps: counted steps that wrote KDA state snapshots (prefix caching: a sequence crossed a 64-token block
  boundary), which the decode graphs do not take (k3.serve.graphs: they run eagerly), and their median ms.
Without `--http` the events go to a list (the engine alone, stepped on this thread). With `--http` the same requests
come through the OpenAI server (serve/server.py on uvicorn, loopback port) as streaming completions from `--batch`
httpx clients in a child process (benchmarks/serve.py's client, so its JSON parsing does not share this process's
GIL); the table adds the step period (start to start) and the event-loop thread's CPU time per generated token (SSE
chunks, JSON, asyncio, uvicorn; the thread's CPU clock between the counted steps).

`--profile` runs the counted window once more under yappi (CPU clock, every thread) and prints, per thread, the
host functions by own time in µs per generated token (functions reached only from `ModelRunner.step` and k3's model
and kernel files are left out; C calls count in their Python caller). The profiler inflates every call (~4x here):
read its rows as shares, and the table above as the absolute numbers.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent


def _serve_bench():
    """benchmarks/serve.py as a module (its release builder and OpenAI client)."""
    spec = importlib.util.spec_from_file_location("k3_bench_serve", HERE / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


class Row(NamedTuple):
    """One engine step as StepProbe saw it (seconds)."""

    wall: float  # Engine.step, wall clock
    model: float  # ModelRunner.step, wall clock (synchronised on CUDA)
    seqs: int  # sequences in the step's forward
    tokens: int  # tokens in the step's forward
    t0: float  # perf_counter at the step's start
    cpu: float  # CPU time of the engine thread in Engine.step
    model_cpu: float  # of which in ModelRunner.step
    loop_cpu: float  # CPU clock of the event-loop thread at the step's start (--http; 0 otherwise)
    snaps: bool  # the step wrote KDA snapshots (prefix caching, a block boundary): never a decode graph


class StepProbe:
    """Wraps an engine's `step` and its runner's `step` (instance attributes, so the engine thread calls them) and
    records a Row per engine step."""

    def __init__(self, engine, batch: int, cuda: bool):
        import torch

        self.engine, self.batch, self.rows = engine, batch, []
        self.loop_clock: int | None = None  # pthread CPU clock id of the event-loop thread (--http)
        self._model = self._model_cpu = 0.0
        self._batch: tuple[int, int] = (0, 0)
        self._snaps = False
        self.on_step = None  # callback(probe) before each step (starts/stops the profiler)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        runner_step, engine_step = engine.runner.step, engine.step

        def timed_runner(seqs):
            c0, t0 = time.thread_time(), time.perf_counter()
            out = runner_step(seqs)
            sync()  # the GPU's time belongs to the model, not to the host work that follows
            self._model += time.perf_counter() - t0
            self._model_cpu += time.thread_time() - c0
            self._batch = (len(seqs), sum(len(s.tokens) for s in seqs))
            self._snaps = any(s.snapshots for s in seqs)
            return out

        def timed_step():
            if self.on_step is not None:
                self.on_step(self)
            loop_cpu = time.clock_gettime(self.loop_clock) if self.loop_clock is not None else 0.0
            self._model = self._model_cpu = 0.0
            self._batch, self._snaps = (0, 0), False
            c0, t0 = time.thread_time(), time.perf_counter()
            ran = engine_step()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            self.rows.append(Row(wall, self._model, *self._batch, t0, cpu, self._model_cpu, loop_cpu, self._snaps))
            return ran

        engine.runner.step, engine.step = timed_runner, timed_step
        self.gc: list[tuple[float, float]] = []  # (perf_counter at the start, seconds) of each collection, any thread
        self._gc_t0 = 0.0

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                self._gc_t0 = time.perf_counter()
            else:
                self.gc.append((self._gc_t0, time.perf_counter() - self._gc_t0))

        gc.callbacks.append(on_gc)

    def full_decode_rows(self, batch: int) -> list[Row]:
        """Rows of the steps that decoded exactly `batch` sequences, one token each."""
        return [r for r in self.rows if r.seqs == batch and r.tokens == batch]


def summarize(probe: StepProbe, batch: int, http: bool) -> dict:
    """Medians over the counted steps (wall clock), host CPU per token (mean; the engine thread's CPU clock, so
    waiting for the GIL or for a core does not count) and, with http, the period and the loop thread's CPU."""
    rows = probe.full_decode_rows(batch)
    if len(rows) < 3:
        raise RuntimeError(f"only {len(rows)} decode steps ran all {batch} sequences; raise --new-tokens")
    def med(xs) -> float:  # ms
        return 1e3 * statistics.median(xs)

    out = {"steps": len(rows), "step_ms": med(r.wall for r in rows), "model_ms": med(r.model for r in rows),
           "host_ms": med(r.wall - r.model for r in rows),
           "host_cpu_us_tok": 1e6 * statistics.fmean(r.cpu - r.model_cpu for r in rows) / batch}
    out["host_us_tok"] = 1e3 * out["host_ms"] / batch
    snap = [r.wall for r in rows if r.snaps]
    out["snap"] = (len(snap), med(snap) if snap else 0.0)
    pauses = [d for t, d in probe.gc if rows[0].t0 <= t <= rows[-1].t0 + rows[-1].wall]
    out["gc"] = (len(pauses), 1e3 * sum(pauses), 1e3 * max(pauses, default=0.0))
    if http:  # consecutive counted steps: period, throughput and the loop thread's CPU in between
        pairs = [(a, b) for a, b in itertools.pairwise(rows) if b.t0 - a.t0 < 10 * max(r.wall for r in rows)]
        out["period_ms"] = med(b.t0 - a.t0 for a, b in pairs)
        out["tok_s"] = batch * len(pairs) / sum(b.t0 - a.t0 for a, b in pairs)
        out["loop_us_tok"] = 1e6 * sum(b.loop_cpu - a.loop_cpu for a, b in pairs) / (batch * len(pairs))
    else:
        out["tok_s"] = batch / statistics.fmean(r.wall for r in rows)
    return out


def print_table(label: str, res: dict, http: bool) -> None:
    print(f"\n{label}")
    cols = ["steps", "engine step ms", "model ms", "host ms", "host µs/token", "host CPU µs/token", "out tok/s",
            "GC pauses: n, total ms, max ms", "snapshot steps: n, ms"]
    cols += ["step period ms", "loop thread CPU µs/token"] if http else []
    print("| " + " | ".join(cols) + " |")
    print("|" + "---:|" * len(cols))
    vals = [f"{res['steps']}", f"{res['step_ms']:.2f}", f"{res['model_ms']:.2f}", f"{res['host_ms']:.2f}",
            f"{res['host_us_tok']:.1f}", f"{res['host_cpu_us_tok']:.1f}", f"{res['tok_s']:.0f}",
            "{}, {:.1f}, {:.1f}".format(*res["gc"]), "{}, {:.2f}".format(*res["snap"])]
    vals += [f"{res['period_ms']:.2f}", f"{res['loop_us_tok']:.1f}"] if http else []
    print("| " + " | ".join(vals) + " |")


# ------------------------------------------------------------------------------------------------ profile


class Profile:
    """yappi over the counted decode steps of one pass: started before the second step that decodes the whole
    batch, stopped before the first step after them; `report` prints host functions by own CPU time per generated
    token, per thread."""

    def __init__(self, batch: int):
        self.batch, self.running, self.done = batch, False, False
        self.rows: list = []  # the probe's rows (the pass's steps)
        self.first = self.last = 0  # rows [first, last) ran under the profiler
        self.names: dict[int, str] = {}

    def _full(self, r: Row) -> bool:
        return r.seqs == self.batch and r.tokens == self.batch

    def __call__(self, probe: StepProbe) -> None:  # before each engine step (engine thread)
        try:
            import yappi
        except ImportError as e:  # raised in the engine thread: the run stops with this message
            raise SystemExit("--profile needs yappi: pip install yappi (or pip install -e '.[dev]')") from e

        self.rows = probe.rows
        full = bool(probe.rows) and self._full(probe.rows[-1])
        if full and not self.running and not self.done:
            yappi.set_clock_type("cpu")
            yappi.start(builtins=False, profile_threads=True)
            self.running, self.first = True, len(probe.rows)
            self.names = {t.ident: t.name for t in threading.enumerate()}  # yappi names threads by class
        elif self.running and not full:
            yappi.stop()
            self.running, self.done, self.last = False, True, len(probe.rows) - 1

    def report(self, top: int = 25) -> None:
        import yappi

        if self.running:
            yappi.stop()
            self.running, self.last = False, len(self.rows)
        tokens = max(sum(r.tokens for r in self.rows[self.first:self.last]), 1)
        stats = yappi.get_func_stats()
        by_key = {(s.module, s.lineno, s.name): s for s in stats}
        model = _reached_from(stats, by_key, lambda s: s.name.endswith("ModelRunner.step") or s.name == "timed_runner")
        threads = {t.id: self.names.get(t.tid, t.name) for t in yappi.get_thread_stats()}
        print(f"\nyappi (CPU clock, profiler overhead included): host functions by own time, µs per generated token "
              f"over {tokens} tokens; model functions (reached only from ModelRunner.step) left out")
        for tid, name in threads.items():
            mine = yappi.get_func_stats(filter_callback=lambda s, tid=tid: s.ctx_id == tid)
            rows = [s for s in mine if (s.module, s.lineno, s.name) not in model and not _model_file(s.module)
                    and os.path.abspath(s.module) != os.path.abspath(__file__)]
            total = sum(s.tsub for s in rows)
            if total * 1e6 / tokens < 1.0:
                continue  # idle helper threads
            print(f"\nthread {name}: {1e6 * total / tokens:.1f} µs/token of host code")
            print("| function | file:line | calls/token | own µs/token | incl µs/token |")
            print("|---|---|---:|---:|---:|")
            for s in sorted(rows, key=lambda s: -s.tsub)[:top]:
                where = f"{_short(s.module)}:{s.lineno}"
                print(f"| {s.name} | {where} | {s.ncall / tokens:.2f} | {1e6 * s.tsub / tokens:.2f} | "
                      f"{1e6 * s.ttot / tokens:.2f} |")
        yappi.clear_stats()


def _model_file(path: str) -> bool:
    """k3's model and kernel code (reached through torch's C++ too, e.g. autograd.Function.apply, where yappi's call
    graph breaks), except the tokenizer, which is host work."""
    p = path.replace(os.sep, "/")
    return any(f"/{d}/" in p for d in ("k3kernels", "model")) and not p.endswith("/tokenizer.py")


def _short(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3", "/work/main/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _reached_from(stats, by_key, is_root) -> set:
    """Keys of the functions called (transitively) from a root. yappi lists no comprehension (genexpr, listcomp)
    as a child: one belongs to the set when the function that encloses it (same file, nearest def above) does."""
    inside, todo = set(), [s for s in stats if is_root(s)]
    while todo:
        s = todo.pop()
        k = (s.module, s.lineno, s.name)
        if k in inside:
            continue
        inside.add(k)
        for c in s.children:
            child = by_key.get((c.module, c.lineno, c.name))
            if child is not None:
                todo.append(child)
    defs: dict[str, list] = {}
    for s in stats:
        if not s.name.startswith("<"):
            defs.setdefault(s.module, []).append((s.lineno, (s.module, s.lineno, s.name)))
    for s in stats:
        if s.name.startswith("<"):
            above = [d for d in defs.get(s.module, []) if d[0] <= s.lineno]
            if above and max(above)[1] in inside:
                inside.add((s.module, s.lineno, s.name))
    return inside


# ------------------------------------------------------------------------------------------------ runs


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


def _passes(probe: StepProbe, profile: Profile | None, run_one, http: bool):
    """An untimed pass (graph captures, lazy set-up), the counted pass, and with a profile a profiled pass, each
    `run_one(seed)` with its own prompts. Returns (the counted pass's summary, what run_one returned there)."""
    counted = None
    for seed in (0, 1, 2) if profile is not None else (0, 1):
        probe.rows.clear()
        probe.on_step = profile if seed == 2 else None
        ret = run_one(seed)
        if seed == 1:
            counted = summarize(probe, probe.batch, http), ret
    probe.on_step = None
    return counted


def run_engine(engine, args, profile: Profile | None) -> dict:
    """The engine alone, stepped on this thread."""
    from k3.serve.request import SamplingParams

    probe = StepProbe(engine, args.batch, args.device.startswith("cuda"))
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    def run_one(seed: int) -> None:
        events = []
        for p in _prompts(args.batch, args.prompt_len, engine.tok.vocab_size, seed):
            engine.submit(p, params, events.append)
        while engine.has_work():
            engine.step()

    return _passes(probe, profile, run_one, http=False)[0]


def _client(url: str, args, vocab: int, seed: int) -> dict:
    """32 streaming completions from a child process (benchmarks/serve.py's OpenAI client)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import serve; "
            "r = serve.bench_openai_server(sys.argv[2], 'k3-host', concurrency=int(sys.argv[3]), "
            "num_prompts=int(sys.argv[3]), input_len=int(sys.argv[4]), output_len=int(sys.argv[5]), "
            "vocab=int(sys.argv[6]), seed=int(sys.argv[7])); print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code, str(HERE), url, str(args.batch), str(args.prompt_len),
                          str(args.new_tokens), str(vocab), str(seed)], capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"client failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_http(state, args, profile: Profile | None) -> tuple[dict, dict]:
    """The same workload through the OpenAI server: (server-side step table, client-side metrics)."""
    import socket

    import uvicorn

    from k3.serve.server import GuardMiddleware, build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(GuardMiddleware(build_app(state), state), host="127.0.0.1", port=port,
                                           log_level="error"))
    clock: list[int] = []

    def serve() -> None:
        clock.append(time.pthread_getcpuclockid(threading.get_ident()))
        server.run()

    th = threading.Thread(target=serve, name="event-loop", daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.02)
    engine = state.engine
    probe = StepProbe(engine, args.batch, args.device.startswith("cuda"))
    probe.loop_clock = clock[0]
    url = f"http://127.0.0.1:{port}"
    try:
        return _passes(probe, profile, lambda seed: _client(url, args, engine.tok.vocab_size, seed), http=True)
    finally:
        server.should_exit = True
        th.join(timeout=10)
        engine.stop()


def serve_config(args, tmp: Path):
    """ServeConfig of a random-weight release of args.model (or --ckpt) for this workload."""
    from k3.serve.config import ServeConfig

    ckpt = args.ckpt or _serve_bench()._random_release(args.model, tmp, args.device)
    dtype = args.dtype if args.dtype != "auto" else ("float32" if args.device == "cpu" else "bfloat16")
    return ServeConfig(ckpt=str(ckpt), device=args.device, dtype=dtype, served_model_name="k3-host",
                       max_num_seqs=args.batch, max_model_len=args.prompt_len + args.new_tokens + 64,
                       max_num_batched_tokens=args.max_num_batched_tokens or args.batch * (args.prompt_len + 1),
                       enable_prefix_caching=not args.no_prefix_caching, cuda_graph_batches=[args.batch],
                       compile_decode=args.compile_decode, log_level="error")


def engine_alone(cfg):
    """The engine as `k3 serve` builds it (k3.serve.server.load_state), without the server: loaded, warmed up,
    start-up heap frozen; not started (the caller steps it)."""
    from k3.model.checkpoint import load_model
    from k3.model.tokenizer import K3Tokenizer
    from k3.serve.engine import Engine
    from k3.serve.server import freeze_heap

    model, _ = load_model(cfg.ckpt, device=cfg.device, dtype=cfg.dtype)
    engine = Engine(model, K3Tokenizer.from_file(cfg.ckpt), cfg)
    engine.warmup()
    freeze_heap()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda (CUDA graphs on)")
    ap.add_argument("--model", default="k3-debug", help="model preset with random weights")
    ap.add_argument("--ckpt", type=Path, help="a release checkpoint instead of random weights")
    ap.add_argument("--dtype", default="auto", help="auto (float32 on a CPU, bfloat16 on a GPU) | float32 | bfloat16")
    ap.add_argument("--batch", type=int, default=32, help="concurrent greedy requests")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="engine token budget (default: all "
                    "prompts in one step, so every sequence decodes in lockstep)")
    ap.add_argument("--compile-decode", action="store_true", help="torch.compile'd CUDA-graph decode (GPU)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="serve without prefix caching (default: on, as "
                    "`k3 serve`; each pass's prompts are new, so there are no hits either way)")
    ap.add_argument("--http", action="store_true", help="through the OpenAI server with streaming clients")
    ap.add_argument("--profile", action="store_true", help="yappi table of host functions per token (see above)")
    ap.add_argument("--top", type=int, default=25, help="rows per thread of the --profile table")
    args = ap.parse_args()
    if args.batch < 1 or args.prompt_len < 1 or args.new_tokens < 8:
        ap.error("--batch and --prompt-len must be >= 1 and --new-tokens >= 8")
    if args.profile:
        try:
            import yappi  # noqa: F401
        except ImportError:
            ap.error("--profile needs yappi (pip install yappi)")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = serve_config(args, Path(tmp))
        profile = Profile(args.batch) if args.profile else None
        where = f"CPU ({torch.get_num_threads()} threads)" if args.device == "cpu" else torch.cuda.get_device_name()
        label = (f"{args.ckpt or args.model} on {where}, {cfg.dtype}, batch {args.batch}, prompt {args.prompt_len}, "
                 f"{args.new_tokens} new tokens, greedy, prefix caching {'off' if args.no_prefix_caching else 'on'}: "
                 f"decode steps of the whole batch")
        if args.http:
            from k3.serve.server import load_state, make_state

            state = make_state(cfg)
            load_state(cfg, state)  # as `k3 serve`: load, warm up, freeze the heap, start the engine thread
            res, client = run_http(state, args, profile)
            print_table(label + ", through HTTP (streaming)", res, http=True)
            print(f"client: {client['output_tok_s']:.0f} out tok/s over the whole run (prefill included), median "
                  f"ITL {client['itl'][1]:.2f} ms, TTFT {client['ttft'][1]:.1f} ms")
        else:
            print_table(label + ", engine only", run_engine(engine_alone(cfg), args, profile), http=False)
    if profile is not None:
        profile.report(args.top)


if __name__ == "__main__":
    main()
