"""Serving benchmark of `k3 serve` (serving.md 4.1): TTFT, TPOT, ITL, E2EL and output tokens/s at several
concurrencies, plus TTFT of a repeated long prompt with and without a prefix-cache hit, and (with
`--speculative-tokens N`) output tokens/s at concurrency 1 with and without MTP speculative decoding.

    python benchmarks/serve.py --ckpt runs/x/final --concurrency 1 8 64 --input-len 128 --output-len 64
    python benchmarks/serve.py --model k3-tiny          # random weights, a small BPE trained here (CPU smoke run)
    python benchmarks/serve.py --ckpt runs/x/final --speculative-tokens 2   # + the speculative row (trained MTP)
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --served-model NAME   # any OpenAI server
    python benchmarks/serve.py --ckpt runs/x/final --subprocess   # `k3 serve` in its own process, as deployed
    python benchmarks/serve.py --model k3-small --device cuda --hf-anchor   # + HF transformers anchors (issue 5)

Definitions follow `vllm bench serve` (vllm/benchmarks/serve.py): TTFT = request sent -> first streamed token;
TPOT = (E2EL - TTFT) / (output tokens - 1) per request; ITL = every gap between consecutive streamed chunks,
pooled; output throughput = generated tokens (from the server's usage) / wall time of the whole batch. Prompts are
random token ids (no prefix sharing), `ignore_eos` with a fixed output length, temperature 0, streaming with
include_usage. Warmup requests run first and are excluded. The client side (`bench_openai_server`) speaks plain
OpenAI HTTP, so anchor rows (another server, e.g. a transformers-based one on the GPU machine) are measured by
pointing it at their URL and adding a row to the same table.

`--hf-anchor` adds, in the same run, Hugging Face `transformers` generate anchors (a dense Llama and the Qwen3-Next
hybrid, random weights at `--hf-preset`'s size, see hf_anchor.py) at `--hf-batch` x `--hf-prompt-len` ->
`--hf-new-tokens`, and k3 at that workload through the same server path (concurrency = batch, one request per slot
so a wave matches HF's single generate batch; 2 requests at batch 1), printed in one table with k3/anchor ratios.
The anchors run after the k3 server is stopped, in this process, on `--device`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
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


def text_prompts(n: int, chars: int, seed: int = 0) -> list[str]:
    """`n` slices of `chars` characters of the running interpreter's standard library sources (the domain of the
    default pretraining corpus): prompts a trained model continues the way it learned, for speculative decoding's
    acceptance (random token ids make the drafter's job artificially hard)."""
    rng = random.Random(seed)
    files = [f for f in sorted(Path(os.__file__).parent.glob("*.py")) if f.stat().st_size > 2 * chars]
    out = []
    while len(out) < n:
        t = rng.choice(files).read_text(errors="replace")
        i = rng.randrange(0, len(t) - chars)
        out.append(t[i:i + chars])
    return out


def bench_openai_server(base_url: str, model: str, *, concurrency: int, num_prompts: int, input_len: int,
                        output_len: int, vocab: int, seed: int = 0, prompts: list | None = None) -> dict:
    """Run `num_prompts` random-token requests (or the given `prompts`, strings or id lists) at `concurrency`
    against an OpenAI-compatible server -> metrics."""
    rng = random.Random(seed)
    if prompts is None:
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
                      output_len: int, vocab: int, text: bool = True) -> dict:
    """Concurrency-1 greedy decoding on a plain server and on one with k MTP drafts: tokens/s, speedup and the
    acceptance the spec server counted (acceptance rate = accepted / draft tokens; mean acceptance length =
    1 + accepted / drafts, vLLM's convention, serving.md 2.4)."""
    prompts = text_prompts(num_prompts + 1, 4 * input_len) if text else None
    kw = {"concurrency": 1, "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
          "vocab": vocab, "prompts": prompts[1:] if text else None}
    for url in (plain_url, spec_url):  # warm-up, excluded: a request like the timed ones (same prompt kind and
        # length, full output), so kernel compilation and lazy graph captures for their shapes happen here; its
        # prompt is not one of the timed ones, which therefore miss the prefix cache on both servers alike
        bench_openai_server(url, model, concurrency=1, num_prompts=1, input_len=input_len, output_len=output_len,
                            vocab=vocab, seed=99, prompts=prompts[:1] if text else None)
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

    # the --hf-anchor workload needs its batch as concurrent slots and its prompt + output within the context
    conc = list(args.concurrency) + (list(args.hf_batch) if args.hf_anchor else [])
    lens = [args.input_len + args.output_len, args.prefix_len + 8]
    # text prompts of 4 * input_len characters: up to ~4x the tokens with a small tokenizer
    lens += [4 * args.input_len + args.output_len] if args.speculative_tokens and args.spec_prompts == "text" else []
    lens += [args.hf_prompt_len + args.hf_new_tokens] if args.hf_anchor else []

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.subprocess:
        return _start_subprocess(ckpt, args, port, max(conc), max(lens) + 64, speculative_tokens)

    import uvicorn

    from k3.serve.config import ServeConfig
    from k3.serve.server import GuardMiddleware, build_app, load_state, make_state

    cfg = ServeConfig(ckpt=str(ckpt), port=port, served_model_name="k3-bench", device=args.device, dtype=args.dtype,
                      max_num_seqs=max(conc), max_model_len=max(lens) + 64,
                      max_num_batched_tokens=args.max_num_batched_tokens, log_level="error",
                      num_speculative_tokens=speculative_tokens, compile_decode=args.compile_decode,
                      **({"cuda_graph_batches": args.cuda_graph_batches} if args.cuda_graph_batches else {}))
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


def _start_subprocess(ckpt: Path, args, port: int, max_batch: int, max_model_len: int,
                      speculative_tokens: int) -> tuple[str, object, int]:
    """`k3 serve` as its own process (as a user runs it; no GIL shared with this client); ready once /health is 200
    (model loaded and warmed). Returns (base URL, stop function, vocab size)."""
    import subprocess

    from k3.model.tokenizer import K3Tokenizer

    cmd = [sys.executable, "-m", "k3.cli.main", "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "k3-bench", "--device", args.device, "--dtype", args.dtype,
           "--max-batch", str(max_batch), "--max-model-len", str(max_model_len),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--speculative-tokens", str(speculative_tokens)] + (["--compile-decode"] if args.compile_decode else []) \
        + (["--cuda-graph-batches", ",".join(map(str, args.cuda_graph_batches))] if args.cuda_graph_batches else [])
    log = tempfile.NamedTemporaryFile("w+", suffix=".k3serve.log", delete=False)  # noqa: SIM115 - lives with proc
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)  # a file: a pipe could fill
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"k3 serve exited with {proc.returncode}: {Path(log.name).read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("k3 serve did not report healthy within 15 minutes")
        time.sleep(0.5)

    def stop():
        proc.terminate()  # SIGTERM: drain, then exit
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
    return url, stop, K3Tokenizer.from_file(ckpt).vocab_size


# ------------------------------------------------------------------------------------------- HF anchors (issue 5)


def _hf_anchor_module():
    """benchmarks/hf_anchor.py, importable however this script was started."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import hf_anchor

    return hf_anchor


def bench_k3_at_anchor_workload(url: str, model: str, args, vocab: int) -> list[dict]:
    """k3 rows at the anchors' workload: concurrency = batch, max(batch, 2) requests of --hf-prompt-len random
    tokens -> --hf-new-tokens, after a short excluded warm-up at the largest batch."""
    top = max(args.hf_batch)
    bench_openai_server(url, model, concurrency=top, num_prompts=top, input_len=args.hf_prompt_len, output_len=4,
                        vocab=vocab)  # warmup at the new shapes, excluded
    return [bench_openai_server(url, model, concurrency=b, num_prompts=max(b, 2), input_len=args.hf_prompt_len,
                                output_len=args.hf_new_tokens, vocab=vocab, seed=7) for b in args.hf_batch]


def _x(ratio: float) -> str:
    return f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.2f}x"


def print_anchor_table(k3_label: str, k3_rows: list[dict], hf_rows: list[dict], args) -> None:
    """One table: k3 rows (median TPOT, median TTFT) and HF rows (ms per decode step, prefill), with
    k3/anchor speed ratios at the same batch: decode = anchor ms per token / k3 ms per token, tok/s = k3 / anchor."""
    print(f"\nk3 vs Hugging Face transformers anchors: prompt {args.hf_prompt_len}, {args.hf_new_tokens} new tokens, "
          f"greedy ({args.device}). k3: server path, concurrency = batch, ms/token = median TPOT, first = median "
          f"TTFT. HF: model.generate of one batch, ms/token = (generate - prefill) / (new tokens - 1), first = "
          f"prefill + first token.")
    hdr = (f"{'system':<36} {'batch':>5} {'out tok/s':>10} {'ms/token':>9} {'first ms':>9} "
           f"{'k3/anchor: decode':>17} {'tok/s':>7}")
    print(hdr)
    print("-" * len(hdr))
    k3_by_batch = {r["concurrency"]: r for r in k3_rows}
    for r in k3_rows:
        print(f"{k3_label:<36} {r['concurrency']:>5} {r['output_tok_s']:>10.1f} {r['tpot'][1]:>9.2f} "
              f"{r['ttft'][1]:>9.1f}")
    for r in hf_rows:
        k = k3_by_batch.get(r["batch"])
        ratios = f"{_x(r['ms_per_step'] / k['tpot'][1]):>17} {_x(k['output_tok_s'] / r['out_tok_s']):>7}" if k else ""
        print(f"{r['label']:<36} {r['batch']:>5} {r['out_tok_s']:>10.1f} {r['ms_per_step']:>9.2f} "
              f"{r['prefill_ms']:>9.1f} {ratios}")
    llama = {r["batch"]: r for r in hf_rows if r["label"].startswith("HF Llama")}
    if args.hf_tiny or not llama:
        return
    goals = []
    if 1 in llama and 1 in k3_by_batch:  # issue 5: >= 20x the HF Llama at batch 1 (k3 <= about 3.3 ms per token)
        x = llama[1]["ms_per_step"] / k3_by_batch[1]["tpot"][1]
        goals.append(f"batch-1 decode >= 20x: {x:.1f}x, k3 {k3_by_batch[1]['tpot'][1]:.2f} ms/token "
                     f"({'met' if x >= 20 else 'NOT met'})")
    if 32 in llama and 32 in k3_by_batch:  # issue 5: >= 10x the HF Llama's batch-32 throughput
        x = k3_by_batch[32]["output_tok_s"] / llama[32]["out_tok_s"]
        goals.append(f"batch-32 throughput >= 10x: {x:.1f}x ({'met' if x >= 10 else 'NOT met'})")
    if goals:
        print("issue 5 goals vs HF Llama: " + "; ".join(goals))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", type=Path, help="release checkpoint to serve in-process")
    src.add_argument("--model", help="model preset with random weights (e.g. k3-tiny)")
    src.add_argument("--base-url", help="benchmark an already running OpenAI-compatible server")
    ap.add_argument("--served-model", default="k3-bench", help="model name for --base-url")
    ap.add_argument("--vocab", type=int, default=256, help="prompt ids are drawn below this with --base-url")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile-decode", action="store_true", help="serve with torch.compile'd CUDA-graph decode steps "
                    "(ServeConfig.compile_decode)")
    ap.add_argument("--cuda-graph-batches", type=int, nargs="+", help="batch sizes the server captures (and with "
                    "--compile-decode compiles) at warm-up (default: the server's 1 8 32); with --compile-decode, "
                    "give the batch sizes the rows run at")
    ap.add_argument("--subprocess", action="store_true", help="run `k3 serve` as its own process (as deployed) "
                    "instead of in this process")
    ap.add_argument("--dtype", default="auto", help="serving dtype (auto | float32 | bfloat16 | float16; auto = "
                    "bfloat16 on a GPU, float16 for a float16 checkpoint, float32 on the CPU: k3 serve's policy)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--num-prompts", type=int, default=0, help="per concurrency level (default: --prompts-per-stream "
                    "x concurrency)")
    ap.add_argument("--prompts-per-stream", type=int, default=2, help="requests per stream at each concurrency level "
                    "when --num-prompts is not given (2: ~1.5 s of work for k3-small at 32 streams on an H200, too "
                    "short to separate a few percent; 8 for A/B comparisons)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1024, help="repeated-prompt length for the prefix-hit row "
                                                                 "(0 = skip)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--speculative-tokens", type=int, default=0, help="also measure concurrency 1 on a second "
                    "in-process server with this many MTP drafts per step (0 = skip; not with --base-url)")
    ap.add_argument("--spec-prompts", choices=["text", "random"], default="text", help="prompts of the speculative "
                    "row: standard-library source text (~4 characters per token; default) or random token ids")
    ap.add_argument("--hf-warmup-new-tokens", type=int, default=16, help="new tokens of each anchor's warm-up run "
                    "(0 = the timed length)")
    ap.add_argument("--hf-anchor", action="store_true", help="also time Hugging Face transformers generate anchors "
                    "(Llama, Qwen3-Next; random weights) and k3 at their workload; one table with ratios (issue 5)")
    ap.add_argument("--hf-batch", type=int, nargs="+", default=[1, 32], help="anchor batch sizes = k3 concurrency")
    ap.add_argument("--hf-new-tokens", type=int, default=256, help="generated tokens per sequence (anchor and k3)")
    ap.add_argument("--hf-prompt-len", type=int, default=128, help="random prompt tokens (anchor and k3)")
    ap.add_argument("--hf-preset", default="k3-small", help="k3 preset whose sizes the anchors take")
    ap.add_argument("--hf-tiny", action="store_true", help="tiny anchors (2 layers, hidden 64) for a CPU smoke run")
    ap.add_argument("--hf-models", nargs="+", choices=["llama", "qwen3next"], default=["llama", "qwen3next"],
                    help="which anchors to time")
    args = ap.parse_args()
    if args.hf_anchor:  # fail before the k3 run, not after it
        if min(args.hf_batch) < 1 or args.hf_prompt_len < 1 or args.hf_new_tokens < 2:
            ap.error("--hf-batch and --hf-prompt-len must be >= 1 and --hf-new-tokens >= 2")
        try:
            _hf_anchor_module().require_transformers()
        except ImportError as e:
            ap.error(str(e))

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
        rows = [bench_openai_server(url, model, concurrency=c,
                                    num_prompts=args.num_prompts or args.prompts_per_stream * c,
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
                                  input_len=args.input_len, output_len=args.output_len, vocab=vocab,
                                  text=args.spec_prompts == "text")
            print(f"\nspeculative (MTP, k={r['k']}, concurrency 1, {args.spec_prompts} prompts): {r['plain_tok_s']:.1f} -> {r['spec_tok_s']:.1f} "
                  f"out tok/s ({r['speedup']:.2f}x), median TPOT {r['tpot_plain']:.2f} -> {r['tpot_spec']:.2f} ms, "
                  f"acceptance rate {r['acceptance_rate']:.2f}, mean acceptance length "
                  f"{r['mean_acceptance_length']:.2f}")
        if args.hf_anchor:
            k3_rows = bench_k3_at_anchor_workload(url, model, args, vocab)
    finally:
        for f in (stop, spec_stop):
            if f is not None:
                f()
    if args.hf_anchor:  # after the k3 server stopped: the anchors get the device to themselves
        hf = _hf_anchor_module()
        print(f"\nHF anchors: transformers {hf.require_transformers().__version__}, torch {hf.torch.__version__}")
        hf_rows = hf.run_anchors(args.hf_models, preset=args.hf_preset, tiny=args.hf_tiny, device=args.device,
                                 batches=args.hf_batch, prompt_len=args.hf_prompt_len, new_tokens=args.hf_new_tokens,
                                 warmup_new_tokens=args.hf_warmup_new_tokens or None)
        print_anchor_table(f"k3 serve {args.ckpt or args.model or url}", k3_rows, hf_rows, args)


if __name__ == "__main__":
    main()
