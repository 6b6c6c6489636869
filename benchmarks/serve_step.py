"""Engine decode-step time without HTTP: k3's serving engine stepped in-process, CUDA-graph decode on vs off.

Run on a CUDA machine (never in tests): `python benchmarks/serve_step.py [--model k3-small] [--batch 1 8 32 64]`.
A release with random weights at the preset's sizes (a small BPE trained here, as benchmarks/serve.py does) is served
in bf16 by `k3.serve.engine.Engine`; B greedy requests of `--prompt-len` random tokens are submitted, the engine is
stepped until every sequence has its first token, then the remaining `--new-tokens` - 1 decode steps are timed
(wall clock, synchronised; after an untimed pass at the same batch size, so JIT compilation is excluded): ms per step = what a streaming client sees as inter-token latency at concurrency B,
minus the HTTP layer. `graphs` = ServeConfig.cuda_graphs (k3.serve.graphs), the rest of the engine identical.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from k3.model.checkpoint import load_model
from k3.model.tokenizer import K3Tokenizer
from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.request import SamplingParams


def _random_release(preset: str, out: Path, device: str = "cuda") -> Path:
    spec = importlib.util.spec_from_file_location("k3_bench_serve", Path(__file__).with_name("serve.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod._random_release(preset, out, device)


def decode_ms(engine: Engine, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    got = [0] * batch
    for b in range(batch):
        def sink(ev, b=b):
            got[b] += len(ev.token_ids)
        engine.submit([rng.randrange(4, vocab) for _ in range(prompt_len)], params, sink)
    while min(got) == 0:  # prefill, first tokens
        engine.step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0, steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    sync()
    return (time.perf_counter() - t0) / max(steps, 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="k3-small")
    ap.add_argument("--ckpt", type=Path, help="a release checkpoint instead of random weights")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--compile-decode", action="store_true", help="also time CUDA graphs of the torch.compile'd "
                    "decode step (ServeConfig.compile_decode)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the static-buffer decode step "
                    "runs eagerly in place of the graphs (no capture on a CPU), compiled with --compile-decode")
    ap.add_argument("--modes", nargs="+", choices=["eager", "graphs", "compiled"], help="which engines to time "
                    "(default: eager and graphs, plus compiled with --compile-decode); each engine's warm-up captures "
                    "only the --batch buckets, so a compiled run compiles no more shapes than it times")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("serve_step.py --device cuda needs a CUDA GPU; use --device cpu for the eager static-buffer path")
    name = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {name}, torch "
          f"{torch.__version__}; {args.ckpt or args.model}, bf16, prompt {args.prompt_len}, {args.new_tokens} tokens")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt or _random_release(args.model, Path(tmp), args.device)
        model, _ = load_model(ckpt, device=args.device, dtype="bfloat16")
        tok = K3Tokenizer.from_file(ckpt)
    rows = {}
    names = args.modes or (["eager", "graphs"] + (["compiled"] if args.compile_decode else []))
    modes = [{"eager": False, "graphs": True, "compiled": "compiled"}[m] for m in names]
    for graphs in modes:
        cfg = ServeConfig(device=args.device, dtype="bfloat16", max_num_seqs=max(args.batch),
                          max_model_len=args.prompt_len + args.new_tokens + 64, max_num_batched_tokens=2048,
                          enable_prefix_caching=False, cuda_graphs=bool(graphs), compile_decode=graphs == "compiled",
                          cuda_graph_batches=list(args.batch))  # warm-up captures (compiles) just the timed buckets
        engine = Engine(model, tok, cfg)
        if graphs and not cuda:  # the same static-buffer step, run eagerly (compiled with --compile-decode)
            engine.runner.enable_decode_graphs(math.ceil(cfg.max_model_len / cfg.kv_block_size), capture=False,
                                               compile=graphs == "compiled")
        t_warm = time.perf_counter()
        engine.warmup()  # captures (and with compiled, compiles) the --batch buckets
        print(f"# graphs={graphs}: warm-up {time.perf_counter() - t_warm:.1f} s", flush=True)
        for b in args.batch:
            # a first pass per batch size compiles whatever is new for it (Triton specialises on sizes, graphs are
            # captured on first use); the second is timed
            decode_ms(engine, b, args.prompt_len, min(args.new_tokens, 8), tok.vocab_size)
            rows[(graphs, b)] = decode_ms(engine, b, args.prompt_len, args.new_tokens, tok.vocab_size)
            print(f"# graphs={graphs} batch={b}: {rows[(graphs, b)]:.2f} ms/step", flush=True)
        n = getattr(engine.runner, "graphs", None)
        print(f"# graphs={graphs}: captured {getattr(n, 'num_graphs', 0)} decode graphs", flush=True)
    g_name = "graphs" if cuda else "static step"
    label = {False: "eager", True: g_name, "compiled": f"compiled {g_name}"}
    print("| batch | " + " | ".join(f"{label[m]} ms/step | {label[m]} tok/s" for m in modes)
          + (f" | eager / {g_name} |" if False in modes and True in modes else " |"))
    print("|---|" + "---|---|" * len(modes) + ("---|" if False in modes and True in modes else ""))
    for b in args.batch:
        cells = " | ".join(f"{rows[(m, b)]:.2f} | {b * 1e3 / rows[(m, b)]:.0f}" for m in modes)
        ratio = f" | {rows[(False, b)] / rows[(True, b)]:.2f} |" if False in modes and True in modes else " |"
        print(f"| {b} | " + cells + ratio)

if __name__ == "__main__":
    main()
