"""Serving benchmark of `k3 serve` (serving.md 4.1): TTFT, TPOT, ITL, E2EL and output tokens/s at several
concurrencies, plus TTFT of a repeated long prompt with and without a prefix-cache hit, and (with
`--speculative-tokens N`) output tokens/s at concurrency 1 with and without MTP speculative decoding.

    python benchmarks/serve.py --ckpt runs/x/final --concurrency 1 8 64 --input-len 128 --output-len 64
    python benchmarks/serve.py --model k3-tiny          # random weights, a small BPE trained here (CPU smoke run)
    python benchmarks/serve.py --ckpt runs/x/final --speculative-tokens 2   # + the speculative row (trained MTP)
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --served-model NAME   # any OpenAI server

Definitions follow `vllm bench serve` (vllm/benchmarks/serve.py): TTFT = request sent -> first streamed token;
TPOT = (E2EL - TTFT) / (output tokens - 1) per request; ITL = every gap between consecutive streamed chunks,
pooled; output throughput = generated tokens (from the server's usage) / wall time of the whole batch. Prompts are
random token ids (no prefix sharing), `ignore_eos` with a fixed output length, temperature 0, streaming with
include_usage. Warmup requests run first and are excluded. The client side (`bench_openai_server`) speaks plain
OpenAI HTTP, so anchor rows (another server, e.g. a transformers-based one on the GPU machine) are measured by
pointing it at their URL and adding a row to the same table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class RequestResult:
    ttft: float
    e2el: float
    itls: list[float]
    output_tokens: int


async def _one(ac: httpx.AsyncClient, model: str, prompt: list[int], out_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, last, itls, n_out = None, None, [], 0
    async with ac.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            now = time.perf_counter()
            if ev.get("usage"):
                n_out = ev["usage"]["completion_tokens"]
            if not ev.get("choices"):
                continue
            if ttft is None:
                ttft = now - t0
            else:
                itls.append(now - last)
            last = now
    return RequestResult(ttft=ttft or 0.0, e2el=time.perf_counter() - t0, itls=itls, output_tokens=n_out)


async def _batch(base_url: str, model: str, prompts: list[list[int]], out_len: int, concurrency: int):
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as ac:
        async def guarded(p):
            async with sem:
                return await _one(ac, model, p, out_len)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(guarded(p) for p in prompts))
        return res, time.perf_counter() - t0


def _stats(xs: list[float]) -> tuple[float, float, float]:
    """mean, median, P99 in milliseconds."""
    if not xs:
        return (float("nan"),) * 3
    s = sorted(xs)
    p99 = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]
    return 1e3 * statistics.fmean(s), 1e3 * statistics.median(s), 1e3 * p99


def bench_openai_server(base_url: str, model: str, *, concurrency: int, num_prompts: int, input_len: int,
                        output_len: int, vocab: int, seed: int = 0) -> dict:
    """Run `num_prompts` random-token requests at `concurrency` against an OpenAI-compatible server -> metrics."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(input_len)] for _ in range(num_prompts)]
    res, wall = asyncio.run(_batch(base_url, model, prompts, output_len, concurrency))
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in res if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in res)
    return {"concurrency": concurrency, "requests": len(res), "duration_s": wall, "output_tok_s": out_tokens / wall,
            "req_s": len(res) / wall, "ttft": _stats([r.ttft for r in res]), "tpot": _stats(tpot),
            "itl": _stats([x for r in res for x in r.itls]), "e2el": _stats([r.e2el for r in res])}


def bench_prefix_hit(base_url: str, model: str, *, prompt_len: int, vocab: int, repeats: int = 3) -> dict:
    """TTFT of a fresh long prompt (miss) vs the same prompt again (prefix hit), median over `repeats` prompts."""
    rng = random.Random(1234)
    cold, warm = [], []
    for _ in range(repeats):
        p = [rng.randrange(4, vocab) for _ in range(prompt_len)]
        for bucket in (cold, warm):
            (r,), _ = asyncio.run(_batch(base_url, model, [p], 2, 1))
            bucket.append(r.ttft)
    return {"prompt_len": prompt_len, "ttft_miss_ms": 1e3 * statistics.median(cold),
            "ttft_hit_ms": 1e3 * statistics.median(warm)}


def print_table(label: str, rows: list[dict]) -> None:
    print(f"\n{label}")
    hdr = (f"{'conc':>5} {'req':>4} {'out tok/s':>10} {'TTFT mean/med/p99 ms':>24} {'TPOT mean/med/p99 ms':>24} "
           f"{'ITL mean/med/p99 ms':>24} {'E2EL mean ms':>12}")
    print(hdr)
    print("-" * len(hdr))
    f = lambda t: "/".join(f"{x:.1f}" for x in t)
    for r in rows:
        print(f"{r['concurrency']:>5} {r['requests']:>4} {r['output_tok_s']:>10.1f} {f(r['ttft']):>24} "
              f"{f(r['tpot']):>24} {f(r['itl']):>24} {r['e2el'][0]:>12.1f}")


# ------------------------------------------------------------------------------------------------ local server


def _random_release(preset: str, out: Path, device: str) -> Path:
    """A release directory with random weights for `preset` and a BPE tokenizer trained on Python's own sources;
    the model's vocab is set to the tokenizer's size (the random weights need no particular vocab)."""
    import dataclasses
    import sysconfig

    from k3.cli.config import load_model_config
    from k3.model.checkpoint import save_release
    from k3.model.tokenizer import train_bpe
    from k3.model.transformer import build_model

    src = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(src.glob("*.py"))[:60]]
    cfg = load_model_config(preset)
    tok = train_bpe(texts, vocab_size=min(cfg.vocab_size, 4096))
    cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size)
    model = build_model(cfg, seed=0)
    tok_dir = tok.save(out / "tok")
    save_release(out / "final", model.state_dict(), cfg, tokenizer_dir=tok_dir)
    return out / "final"


def spec_counters(base_url: str) -> dict[str, float]:
    """The k3:spec_decode_* counters of a k3 server's /metrics (summed over labels)."""
    out: dict[str, float] = {}
    for line in httpx.get(base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("k3:spec_decode_num_") and "_per_pos" not in line:
            name, v = line.rsplit(" ", 1)
            key = name.split("{")[0].removeprefix("k3:spec_decode_num_").removesuffix("_total")
            out[key] = out.get(key, 0.0) + float(v)
    return out


def bench_speculative(plain_url: str, spec_url: str, model: str, *, k: int, num_prompts: int, input_len: int,
                      output_len: int, vocab: int) -> dict:
    """Concurrency-1 greedy decoding on a plain server and on one with k MTP drafts: tokens/s, speedup and the
    acceptance the spec server counted (acceptance rate = accepted / draft tokens; mean acceptance length =
    1 + accepted / drafts, vLLM's convention, serving.md 2.4)."""
    kw = {"concurrency": 1, "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
          "vocab": vocab}
    bench_openai_server(spec_url, model, concurrency=1, num_prompts=1, input_len=input_len, output_len=4,
                        vocab=vocab)  # warmup of the speculative path, excluded
    plain = bench_openai_server(plain_url, model, **kw)
    before = spec_counters(spec_url)
    spec = bench_openai_server(spec_url, model, **kw)
    c = {key: v - before.get(key, 0.0) for key, v in spec_counters(spec_url).items()}
    drafts, proposed, accepted = c.get("drafts", 0.0), c.get("draft_tokens", 0.0), c.get("accepted_tokens", 0.0)
    return {"k": k, "plain_tok_s": plain["output_tok_s"], "spec_tok_s": spec["output_tok_s"],
            "speedup": spec["output_tok_s"] / plain["output_tok_s"], "tpot_plain": plain["tpot"][1],
            "tpot_spec": spec["tpot"][1], "acceptance_rate": accepted / proposed if proposed else float("nan"),
            "mean_acceptance_length": 1 + accepted / drafts if drafts else float("nan")}


def start_local(ckpt: Path, args, speculative_tokens: int = 0) -> tuple[str, object, int]:
    """Load `ckpt`, start uvicorn on a free loopback port in this process; returns (base URL, stop function, vocab size)."""
    import socket

    import uvicorn

    from k3.serve.config import ServeConfig
    from k3.serve.server import GuardMiddleware, build_app, load_state, make_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ServeConfig(ckpt=str(ckpt), port=port, served_model_name="k3-bench", device=args.device,
                      max_num_seqs=max(args.concurrency), max_model_len=max(args.input_len + args.output_len,
                                                                           args.prefix_len + 8) + 64,
                      max_num_batched_tokens=args.max_num_batched_tokens, log_level="error",
                      num_speculative_tokens=speculative_tokens)
    state = make_state(cfg)
    load_state(cfg, state)
    server = uvicorn.Server(uvicorn.Config(GuardMiddleware(build_app(state), state), host="127.0.0.1", port=port,
                                           log_level="error"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        th.join(timeout=10)
        state.engine.stop()
    return f"http://127.0.0.1:{port}", stop, state.engine.tok.vocab_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", type=Path, help="release checkpoint to serve in-process")
    src.add_argument("--model", help="model preset with random weights (e.g. k3-tiny)")
    src.add_argument("--base-url", help="benchmark an already running OpenAI-compatible server")
    ap.add_argument("--served-model", default="k3-bench", help="model name for --base-url")
    ap.add_argument("--vocab", type=int, default=256, help="prompt ids are drawn below this with --base-url")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--num-prompts", type=int, default=0, help="per concurrency level (default 2 x concurrency)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1024, help="repeated-prompt length for the prefix-hit row "
                                                                 "(0 = skip)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--speculative-tokens", type=int, default=0, help="also measure concurrency 1 on a second "
                    "in-process server with this many MTP drafts per step (0 = skip; not with --base-url)")
    args = ap.parse_args()

    stop = spec_stop = None
    if args.base_url:
        url, model, vocab = args.base_url, args.served_model, args.vocab
    else:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = args.ckpt or _random_release(args.model, Path(tmp), args.device)
            url, stop, vocab = start_local(ckpt, args)
            if args.speculative_tokens:
                spec_url, spec_stop, _ = start_local(ckpt, args, args.speculative_tokens)
        model = "k3-bench"
    try:
        bench_openai_server(url, model, concurrency=2, num_prompts=2, input_len=args.input_len, output_len=4,
                            vocab=vocab)  # warmup, excluded
        rows = [bench_openai_server(url, model, concurrency=c, num_prompts=args.num_prompts or 2 * c,
                                    input_len=args.input_len, output_len=args.output_len, vocab=vocab)
                for c in args.concurrency]
        label = f"k3 serve {args.ckpt or args.model or url} ({args.device}), input {args.input_len}, " \
                f"output {args.output_len}, temperature 0, ignore_eos"
        print_table(label, rows)
        if args.prefix_len:
            r = bench_prefix_hit(url, model, prompt_len=args.prefix_len, vocab=vocab)
            print(f"\nprefix cache: {r['prompt_len']}-token prompt, TTFT miss {r['ttft_miss_ms']:.1f} ms, hit "
                  f"{r['ttft_hit_ms']:.1f} ms ({r['ttft_miss_ms'] / max(r['ttft_hit_ms'], 1e-9):.1f}x)")
        if spec_stop is not None:
            r = bench_speculative(url, spec_url, model, k=args.speculative_tokens, num_prompts=args.num_prompts or 4,
                                  input_len=args.input_len, output_len=args.output_len, vocab=vocab)
            print(f"\nspeculative (MTP, k={r['k']}, concurrency 1): {r['plain_tok_s']:.1f} -> {r['spec_tok_s']:.1f} "
                  f"out tok/s ({r['speedup']:.2f}x), median TPOT {r['tpot_plain']:.2f} -> {r['tpot_spec']:.2f} ms, "
                  f"acceptance rate {r['acceptance_rate']:.2f}, mean acceptance length "
                  f"{r['mean_acceptance_length']:.2f}")
    finally:
        for f in (stop, spec_stop):
            if f is not None:
                f()


if __name__ == "__main__":
    main()
