"""Serve test fixtures: one tiny trained checkpoint per session and a live server on a free loopback port."""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from k3.cli.config import resolve_config
from k3.model.checkpoint import load_model
from k3.model.tokenizer import K3Tokenizer
from k3.serve.chat import ChatTemplate
from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.server import GuardMiddleware, attach_engine, build_app, make_server, make_state
from k3.train.pretrain import run


class CacheCheck:
    """What the graph fast-path tests (decode, prefill tails) check on an engine's caches: `pools(eng)` clones every
    cache tensor (per KDA layer the state and 3 conv tails, per MLA layer the latent pages); `untouched(eng, before,
    batch, page)` asserts bit-identity of every KDA state row, conv-tail row and latent row that the step's real
    sequences do not own (their slots, and the latent rows of positions start .. start + len(tokens) - 1)."""

    @staticmethod
    def pools(eng) -> list[torch.Tensor]:
        out = [t.clone() for t in eng.states.state]
        out += [t.clone() for tails in eng.states.tails for t in tails]
        return out + [t.clone() for t in eng.pages.kv]

    @staticmethod
    def untouched(eng, before: list[torch.Tensor], batch, page: int) -> None:
        after = CacheCheck.pools(eng)
        n_kda = len(eng.states.state)
        own = torch.zeros(eng.states.state[0].shape[0], dtype=torch.bool, device=eng.device)
        own[[s.slot for s in batch]] = True
        for x, y in zip(before[:n_kda], after[:n_kda]):
            assert torch.equal(x[~own], y[~own])
        for x, y in zip(before[n_kda:4 * n_kda], after[n_kda:4 * n_kda]):
            assert torch.equal(x[~own[:x.shape[0]]], y[~own[:x.shape[0]]])
        rows = torch.ones(eng.pages.num_pages * page, dtype=torch.bool, device=eng.device)
        rows[[s.block_table[p // page] * page + p % page for s in batch
              for p in range(s.start, s.start + len(s.tokens))]] = False
        for x, y in zip(before[4 * n_kda:], after[4 * n_kda:]):
            assert torch.equal(x.flatten(0, 1)[rows], y.flatten(0, 1)[rows])


@pytest.fixture(scope="session")
def caches():
    """CacheCheck (cache snapshots and the untouched-rows check of the graph fast-path tests)."""
    return CacheCheck


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """k3-debug trained for a few steps (sharper than random init, so greedy argmax has no near-ties)."""
    root = tmp_path_factory.mktemp("serve_ckpt")
    sets = ["train.max_steps=30", "train.batch_size=8", "data.max_bytes=400000", "data.tokenizer_sample_bytes=200000",
            f"data.cache_dir={root / 'cache'}", "train.eval_every=0", "ckpt.every=0", "train.log_every=10",
            "train.threads=1"]
    run(resolve_config("pretrain", preset="debug", sets=sets), run_dir=root / "run")
    return root / "run" / "final"


@pytest.fixture(scope="session")
def model_tok(ckpt):
    model, _ = load_model(ckpt)
    return model, K3Tokenizer.from_file(ckpt)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    state: object
    server: object
    thread: threading.Thread

    @property
    def engine(self) -> Engine:
        return self.state.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.stop()


def start_server(model, tok, ckpt, **overrides) -> LiveServer:
    """Build the app around an in-memory model and serve it with uvicorn on a background thread."""
    cfg = ServeConfig(**{"ckpt": str(ckpt), "port": free_port(), "served_model_name": "k3-test", "max_model_len": 512,
                         "max_num_seqs": 8, "max_num_batched_tokens": 128, **overrides})
    state = make_state(cfg)
    app = GuardMiddleware(build_app(state), state)
    server = make_server(app, state, host="127.0.0.1", port=cfg.port, log_level="warning", timeout_graceful_shutdown=1)
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{cfg.port}"
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.02)
    live = LiveServer(url, state, server, th)
    live.health_before_load = httpx.get(url + "/health").status_code
    attach_engine(state, Engine(model, tok, cfg, state.metrics), ChatTemplate(tok, ckpt))
    return live


@pytest.fixture(scope="session")
def server(model_tok, ckpt):
    live = start_server(*model_tok, ckpt)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def server_factory(model_tok, ckpt):
    """Start an extra server with ServeConfig overrides: `live = server_factory(api_keys=[...])`; call live.stop().
    `tok=` and `ckpt_dir=` replace the tokenizer and the checkpoint directory (its tokenizer_config.json)."""
    model, tok0 = model_tok
    return lambda tok=None, ckpt_dir=None, **overrides: start_server(model, tok or tok0, ckpt_dir or ckpt, **overrides)


@pytest.fixture
def forbid_host_sync(monkeypatch):
    """`forbid_host_sync(what)`: from then on any tensor -> host read (.item(), .tolist(), bool(t), ...) raises
    AssertionError naming `what`. The static step functions must run without one, or CUDA could not capture them."""
    def arm(what: str) -> None:
        def sync(*_a, **_k):
            raise AssertionError(f"host sync inside {what}")

        for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            monkeypatch.setattr(torch.Tensor, name, sync)
        with pytest.raises(AssertionError, match="host sync"):
            bool(torch.ones(1))  # the patch is live

    return arm


HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__index__", "__float__")


@pytest.fixture
def spy_reads(monkeypatch):
    """spy_reads(mp=monkeypatch) -> Counter: from the call on, every tensor -> host value read (HOST_READS methods),
    counted by ("folder/file" of the caller, method); pass a `monkeypatch.context()` to stop counting when it exits."""
    def start(mp=monkeypatch) -> collections.Counter:
        where = collections.Counter()
        for name in HOST_READS:
            orig = getattr(torch.Tensor, name)

            def spy(self, *a, _orig=orig, _name=name, **kw):
                frame = traceback.extract_stack(limit=2)[0]
                where[(Path(frame.filename).parent.name + "/" + Path(frame.filename).name, _name)] += 1
                return _orig(self, *a, **kw)

            mp.setattr(torch.Tensor, name, spy)
        return where
    return start


@pytest.fixture
def serve_process():
    """serve_process(ckpt, *flags) -> context manager: `k3 serve CKPT --port P *flags` as its own process (torch
    kernels), /health polled until 200 (or the process exits, or 60 s). Yields a namespace: url, statuses (every
    /health answer, None while not listening), log (the process output, set once it exited); terminated on exit."""
    @contextlib.contextmanager
    def start(ckpt, *flags):
        port = free_port()
        code = "import typer; from k3.cli.commands.serve import serve; typer.run(serve)"
        proc = subprocess.Popen([sys.executable, "-c", code, str(ckpt), "--port", str(port), *flags],
                                env={**os.environ, "K3_KERNELS": "torch"}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        run = types.SimpleNamespace(url=f"http://127.0.0.1:{port}", statuses=[], log="")
        try:
            deadline = time.time() + 60
            while time.time() < deadline and proc.poll() is None:
                try:
                    run.statuses.append(httpx.get(run.url + "/health", timeout=2).status_code)
                except httpx.TransportError:
                    run.statuses.append(None)  # not listening yet
                if run.statuses[-1] == 200:
                    break
                time.sleep(0.05)
            if proc.poll() is not None:  # it died: its output is the failure message
                run.log = proc.stdout.read().decode()
            yield run
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            run.log = run.log or proc.stdout.read().decode()
    return start


def _lm_eval_split(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The tokens lm-eval scores (its documented causal-model rule): an empty context is the prefix token (BOS);
    otherwise the context's trailing whitespace moves to the continuation, the whole text is encoded once and split
    at the context's own token count."""
    if not context:
        return [tok.bos_id], tok.encode(continuation)
    stripped = context.rstrip()
    continuation, context = context[len(stripped):] + continuation, stripped
    whole = tok.encode(context + continuation)
    n = len(tok.encode(context))
    return whole[:n], whole[n:]


def _model_loglikelihood(model, ctx: list[int], cont: list[int]) -> float:
    """sum log p(cont | ctx) from K3Model's own full forward, in float64."""
    ids = ctx + cont
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    return sum(lp[i - 1, ids[i]].item() for i in range(len(ctx), len(ids)))


@pytest.fixture
def lm_eval_reference():
    """What lm-eval's numbers must equal: .split(tok, context, continuation) -> (ctx ids, cont ids) and
    .loglikelihood(model, ctx, cont) (the model's own forward)."""
    return types.SimpleNamespace(split=_lm_eval_split, loglikelihood=_model_loglikelihood)
