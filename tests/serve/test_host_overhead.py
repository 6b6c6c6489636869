"""Host-overhead paths of serving (benchmarks/serve_host.py): preformatted SSE chunks, batched metrics, the request
mailbox, coalesced stream writes, the frozen start-up heap, and the benchmark's own step accounting. Each fast path is
checked against the straightforward formula it replaces (json.dumps of the chunk dict, per-observation bucket counts,
asyncio.wait_for semantics)."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import sys
import time
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.jobs import ChunkTemplate, Delivery, Job, Mailbox
from k3.serve.metrics import ITL_BUCKETS, TOKEN_BUCKETS, Metrics
from k3.serve.request import SamplingParams, SeqEvent
from k3.serve.server import freeze_heap

TEXTS = ["", "a", "hello world", 'quo"te', "back\\slash", "new\nline\ttab\r", "\x00\x1f ctrl", "日本語", "emoji 🙂",
         "\u2028\u2029 separators", "</script>", "\ufffd", "  spaced  "]


def _dumps(obj) -> str:
    """The reference: what the stream sent before the templates (json.dumps of the chunk dict)."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("model", ["k3-test", 'we"ird\\ näme'])
def test_chunk_template_bytes_equal_json_dumps(usage, model):
    for obj_name in ("text_completion", "chat.completion.chunk"):
        head = {"id": "cmpl-0123", "object": obj_name, "created": 1700000000, "model": model}
        tpl = ChunkTemplate(head, usage)
        extra = {"usage": None} if usage else {}
        for index in (0, 7, 31):
            for text in TEXTS:
                for reason in (None, "stop", "length", "abort"):
                    ref = {**head, "choices": [{"index": index, "text": text, "logprobs": None,
                                                "finish_reason": reason}], **extra}
                    assert tpl.completion(index, text, reason) == _dumps(ref)
                ref = {**head, "choices": [{"index": index, "delta": {"content": text}, "logprobs": None,
                                            "finish_reason": None}], **extra}
                assert tpl.chat_delta(index, text) == _dumps(ref)
            for reason in ("stop", "length", "abort"):
                ref = {**head, "choices": [{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}],
                       **extra}
                assert tpl.chat_finish(index, reason) == _dumps(ref)


def _naive_histogram(values, buckets):
    """Cumulative bucket counts as the exposition format defines them: observations <= each bound."""
    return [sum(v <= b for v in values) for b in buckets], sum(values), len(values)


def _series(text: str, name: str, extra: str = "") -> list[tuple[str, str]]:
    return [tuple(line.rsplit(" ", 1)) for line in text.splitlines()
            if line.startswith(name) and (extra in line)]


def test_histogram_bisect_and_batches_match_naive_counts():
    m = Metrics("k3-test")
    itl = [0.0, 0.01, 0.0100001, 0.025, 0.3, 79.9, 80.0, 80.5, 1e6, 0.0049]  # on, between and beyond the bounds
    m.observe("k3:inter_token_latency_seconds", itl[0])
    m.observe_many("k3:inter_token_latency_seconds", itl[1:6])
    m.observe_many("k3:inter_token_latency_seconds", [])
    for v in itl[6:]:
        m.observe("k3:inter_token_latency_seconds", v)
    toks = [1, 2, 3, 100, 100000, 200000]
    m.observe_many("k3:request_generation_tokens", toks)
    text = m.render()
    for name, vals, buckets in (("k3:inter_token_latency_seconds", itl, ITL_BUCKETS),
                                ("k3:request_generation_tokens", toks, TOKEN_BUCKETS)):
        cum, total, count = _naive_histogram(vals, buckets)
        got = [int(v) for _, v in _series(text, name + "_bucket")]
        assert got == cum + [count]  # + the +Inf bucket
        assert float(_series(text, name + "_sum")[0][1]) == pytest.approx(total)
        assert m.get(name) == count
    m.inc("k3:generation_tokens", 5)
    m.inc("k3:generation_tokens")
    m.inc("k3:request_success", finished_reason="stop")
    assert m.get("k3:generation_tokens") == 6 and m.get("k3:request_success", finished_reason="stop") == 1
    assert 'k3:generation_tokens_total{model_name="k3-test"} 6' in m.render()


def test_engine_token_metrics_counted_once_per_token(model_tok):
    model, tok = model_tok
    eng = Engine(model, tok, ServeConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=128))
    evs = eng.generate(tok.encode("def f(x):", add_bos=True), SamplingParams(temperature=0.0, max_tokens=6,
                                                                             ignore_eos=True), n=3)
    n_tokens = sum(len(e.token_ids) for es in evs for e in es)
    m = eng.metrics
    assert n_tokens == 18 and m.get("k3:generation_tokens") == n_tokens
    assert m.get("k3:time_to_first_token_seconds") == 3  # one first token per sequence
    assert m.get("k3:inter_token_latency_seconds") == n_tokens - 3  # every later token one gap


# ------------------------------------------------------------------------------------------------ mailbox


def test_mailbox_wait_semantics_and_one_timer():
    async def main():
        loop = asyncio.get_running_loop()
        box = Mailbox(loop)
        arms = []
        real = loop.call_at
        loop.call_at = lambda when, cb, *a, **kw: (cb == box._on_timer and arms.append(when)) or real(when, cb, *a,
                                                                                                         **kw)
        box.put_nowait("x")
        assert await box.wait(0.05) and not arms  # queued already: no future, no timer
        box.items.clear()
        t0 = time.monotonic()
        assert not await box.wait(0.05)  # nothing came: times out, not earlier
        assert time.monotonic() - t0 >= 0.045
        loop.call_later(0.01, box.put_nowait, "y")
        assert await box.wait(5.0)  # an event wakes the wait long before the timeout
        assert list(box.items) == ["y"]
        box.items.clear()
        n_arms = len(arms)
        for i in range(50):  # a stream's steady state: every wait ends with an event, the timer is not re-armed
            loop.call_soon(box.put_nowait, i)
            assert await box.wait(5.0)
            box.items.clear()
        assert len(arms) == n_arms
        # a wait that starts after the timer was armed times out `timeout` after its own start
        box.close()
        loop.call_later(0.03, box.put_nowait, "z")
        assert await box.wait(0.05)
        box.items.clear()
        t1 = time.monotonic()
        assert not await box.wait(0.05)
        assert time.monotonic() - t1 >= 0.045
        box.close()

    asyncio.run(main())


def test_delivery_to_mailboxes_keeps_order():
    async def main():
        loop = asyncio.get_running_loop()
        d = Delivery(loop)
        a, b = Mailbox(loop), Mailbox(loop)
        for i in range(4):
            d.put(a, i)
            d.put(b, 10 + i)
        assert await a.wait(1.0) and await b.wait(1.0)
        assert list(a.items) == [0, 1, 2, 3] and list(b.items) == [10, 11, 12, 13]

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------ streams


def _job(n_seqs: int, rid: str = "cmpl-test") -> Job:
    """A Job wired to fakes: the parts _stream uses (state config, request, engine abort)."""
    job = Job.__new__(Job)
    job.state = SimpleNamespace(cfg=SimpleNamespace(sse_ping_interval_s=15.0), model_name="k3-test")
    job.request = SimpleNamespace(is_disconnected=lambda: asyncio.sleep(0, result=False))
    job.engine, job.rid, job.created, job.seq_ids, job.n_seqs = SimpleNamespace(abort=lambda ids: None), rid, 17, [], \
        n_seqs
    job.fmt = None
    return job


def _events(n_seqs: int, steps: int) -> list[SeqEvent]:
    out = []
    for t in range(steps):
        for i in range(n_seqs):
            last = t == steps - 1
            out.append(SeqEvent(seq_id=f"s{i}", index=i, text=TEXTS[(t + i) % len(TEXTS)], token_ids=[t],
                                logprobs=None, finish_reason="length" if last else None, num_prompt_tokens=4,
                                num_output_tokens=t + 1))
    return out


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_bytes_equal_reference_whether_events_come_alone_or_together(kind):
    n, steps = 3, 5
    evs = _events(n, steps)
    req = SimpleNamespace(stream_options=SimpleNamespace(include_usage=True), n=n, echo=False, logprobs=None)
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    head = {"id": f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-test", "object": obj, "created": 17,
            "model": "k3-test"}
    ref = []  # the pre-template formula, event by event
    if kind == "chat":
        ref += [_dumps({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}], "usage": None})
                for i in range(n)]
    for e in evs:
        if kind == "completion":
            if e.text or e.finish_reason:
                ref.append(_dumps({**head, "choices": [{"index": e.index, "text": e.text, "logprobs": None,
                                                        "finish_reason": e.finish_reason}], "usage": None}))
            continue
        if e.text:
            ref.append(_dumps({**head, "choices": [{"index": e.index, "delta": {"content": e.text},
                                                    "logprobs": None, "finish_reason": None}], "usage": None}))
        if e.finish_reason:
            ref.append(_dumps({**head, "choices": [{"index": e.index, "delta": {}, "logprobs": None,
                                                    "finish_reason": e.finish_reason}], "usage": None}))
    usage = {"prompt_tokens": 4, "completion_tokens": n * steps, "total_tokens": 4 + n * steps,
             "prompt_tokens_details": {"cached_tokens": 0}}
    ref += [_dumps({**head, "choices": [], "usage": usage}), "data: [DONE]\n\n"]

    async def run(together: bool) -> list[str]:
        job = _job(n, head["id"])
        job.loop = asyncio.get_running_loop()
        job.queue = Mailbox(job.loop)
        job._n_prompts = 1
        if kind == "completion":
            gen = job.stream_completion(req, ["p"], [[1, 2, 3, 4]])
        else:
            req.messages, req.echo = [], False
            gen = job.stream_chat(req)
        out = []

        async def feed():
            if together:
                for e in evs:
                    job.queue.put_nowait(e)
                return
            for e in evs:  # one event per loop turn: the reader sees them one by one
                job.queue.put_nowait(e)
                await asyncio.sleep(0)
                await asyncio.sleep(0)

        feeder = asyncio.ensure_future(feed())
        async for piece in gen:
            out.append(piece)
        await feeder
        return out

    alone, together = asyncio.run(run(False)), asyncio.run(run(True))
    assert "".join(alone) == "".join(ref) == "".join(together)
    assert len(together) < len(alone)  # queued events went out in one write


def test_freeze_heap_moves_startup_objects_to_the_permanent_generation():
    try:
        freeze_heap()
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()


# ------------------------------------------------------------------------------------------------ benchmark


def _serve_host():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_host.py"
    spec = importlib.util.spec_from_file_location("k3_bench_serve_host", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_serve_host_counts_the_batch_decode_steps(model_tok, capsys):
    bench = _serve_host()
    model, tok = model_tok
    batch, new = 3, 8
    eng = Engine(model, tok, ServeConfig(max_num_seqs=batch, max_model_len=128, max_num_batched_tokens=64))
    args = Namespace(batch=batch, prompt_len=16, new_tokens=new, device="cpu")
    prof = bench.Profile(batch)
    res = bench.run_engine(eng, args, prof)
    # the prefill step samples each first token; the other new - 1 tokens come from whole-batch decode steps
    assert res["steps"] == new - 1
    assert 0 <= res["model_ms"] <= res["step_ms"] and res["host_ms"] >= 0 and res["host_cpu_us_tok"] > 0
    prof.report(top=40)
    out = capsys.readouterr().out
    assert "| OutputProcessor.append |" in out and "| ModelRunner.step |" not in out  # host rows only, not the model
