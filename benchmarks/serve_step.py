"""Engine decode-step time without HTTP: k3's serving engine stepped in-process, CUDA-graph decode on vs off.

Run on a CUDA machine (never in tests): `python benchmarks/serve_step.py [--model k3-small] [--batch 1 8 32 64]`.
A release with random weights at the preset's sizes (a small BPE trained here, as benchmarks/serve.py does) is served
in bf16 by `k3.serve.engine.Engine`; B greedy requests of `--prompt-len` random tokens are submitted, the engine is
stepped until every sequence has its first token, then the remaining `--new-tokens` - 1 decode steps are timed
(wall clock, synchronised; after an untimed pass at the same batch size, so JIT compilation is excluded): ms per step = what a streaming client sees as inter-token latency at concurrency B,
minus the HTTP layer. `graphs` = ServeConfig.cuda_graphs (k3.serve.graphs), the rest of the engine identical.

`--prefill-lens N [N ...]` times eager PREFILL steps instead (prefix caching on, as a server runs): per N, the step
that prefills a single prompt of N random tokens (an untimed pass first, then the median of 3, synchronised; one
`Engine.step()`, sampling included) and the prefix-hit step (the same prompt again after it finished: the step
that prefills the tail after the deepest cached block). `--profile` adds, per case, torch.profiler's top 15 ops by
self CPU time and the count of host waits (cudaStreamSynchronize / cudaDeviceSynchronize calls, device -> host
memcpys) and kernel launches, over one more step. Without `--prefill-lens`, `--profile` profiles 16 decode steps of
each mode and batch after its timing: wall ms per step, device busy ms per step and the top 20 kernels by device time
per step (on CUDA the kernels inside graph replays are listed too; inductor's fused kernels by their triton_* names).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import random
import statistics
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


def decode_ms(engine: Engine, batch: int, prompt_len: int, new_tokens: int, vocab: int, with_steps: bool = False,
              on_start=None):
    """ms per engine step after the prefill (and with `with_steps`, also the number of steps timed); `on_start()` is
    called when the timed steps begin."""
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
    if on_start is not None:
        on_start()
    t0, steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    sync()
    ms = (time.perf_counter() - t0) / max(steps, 1) * 1e3
    return (ms, steps) if with_steps else ms


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _prefill_step(engine: Engine, prompt: list[int], device: str, profile: bool = False):
    """Submit `prompt` (greedy, one token), run the one step that prefills it (the whole prompt, or the tail after a
    prefix hit) and samples; returns (ms, cached prompt tokens, the profiler or None)."""
    events = []
    engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), events.append)
    prof = None
    _sync(device)
    t0 = time.perf_counter()
    if profile:
        from torch.profiler import ProfilerActivity
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch.profiler.profile(activities=acts) as prof:
            engine.step()
            _sync(device)
    else:
        engine.step()
        _sync(device)
    ms = (time.perf_counter() - t0) * 1e3
    if engine.has_work() or not events or events[-1].finish_reason is None:
        raise RuntimeError(f"the prefill of {len(prompt)} tokens took more than one step; raise "
                           f"max_num_batched_tokens")
    return ms, events[-1].num_cached_tokens, prof


def _print_profile(label: str, prof) -> None:
    """torch.profiler's top 15 ops by self CPU time, then the step's host waits and kernel launches."""
    evs = prof.events()

    def count(pred) -> int:
        return sum(1 for e in evs if pred(e.name))

    syncs = count(lambda n: n in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    d2h = count(lambda n: n.startswith("Memcpy DtoH"))
    launches = count(lambda n: n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"))
    aten = count(lambda n: n.startswith("aten::"))
    print(f"# profile {label}: cudaStreamSynchronize/cudaDeviceSynchronize {syncs}, Memcpy DtoH {d2h}, kernel "
          f"launches {launches}, aten op calls (nested included) {aten}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def profile_decode(engine: Engine, batch: int, prompt_len: int, vocab: int, label: str, steps: int = 16) -> None:
    """Profile `steps` decode steps at `batch` (after the prefill): wall and device-busy ms per step, then the top 20
    kernels by device time per step."""
    from torch.profiler import ProfilerActivity
    rng = random.Random(batch + 1)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    got = [0] * batch
    for b in range(batch):
        engine.submit([rng.randrange(4, vocab) for _ in range(prompt_len)], params,
                      lambda ev, b=b: got.__setitem__(b, got[b] + len(ev.token_ids)))
    while min(got) == 0:
        engine.step()
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync("cuda" if cuda else "cpu")
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        _sync("cuda" if cuda else "cpu")
    wall = (time.perf_counter() - t0) / steps * 1e3
    while engine.has_work():
        engine.step()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.self_device_time_total > 0]
    busy = sum(e.self_device_time_total for e in kernels) / steps / 1e3
    print(f"# profile {label} batch={batch}: wall {wall:.3f} ms/step (profiler on), device busy {busy:.3f} ms/step, "
          f"{sum(e.count for e in kernels) / steps:.0f} kernels/step")
    print("| kernel (name cut to 80) | calls/step | µs/step |")
    print("|---|---:|---:|")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:20]:
        print(f"| {e.key[:80]} | {e.count / steps:.1f} | {e.self_device_time_total / steps:.1f} |")
    host = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    print("| host op (name cut to 80) | calls/step | self CPU µs/step |")
    print("|---|---:|---:|")
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:15]:
        print(f"| {e.key[:80]} | {e.count / steps:.1f} | {e.self_cpu_time_total / steps:.1f} |")


def prefill_bench(engine: Engine, lens: list[int], vocab: int, device: str, profile: bool) -> None:
    """Time eager single-sequence prefill steps, a miss and a prefix hit per length (see the module docstring)."""
    rng = random.Random(0)
    rows = []
    for n in lens:
        times = []
        for rep in range(4):  # the first pass compiles what is new for this length (Triton specialises on sizes)
            engine.reset_prefix_cache()  # a miss every time
            ms, _, _ = _prefill_step(engine, [rng.randrange(4, vocab) for _ in range(n)], device)
            times.append(ms)
        miss = statistics.median(times[1:])
        if profile:
            engine.reset_prefix_cache()
            _print_profile(f"miss {n}", _prefill_step(engine, [rng.randrange(4, vocab) for _ in range(n)], device,
                                                      profile=True)[2])
        engine.reset_prefix_cache()
        prompt = [rng.randrange(4, vocab) for _ in range(n)]
        _prefill_step(engine, prompt, device)  # fills the cache: pages and KDA snapshots of every full block
        hits = [_prefill_step(engine, prompt, device) for _ in range(4)]  # again: the tail after the cached blocks
        hit, cached = statistics.median(h[0] for h in hits[1:]), hits[-1][1]
        if profile:
            _print_profile(f"hit {n} ({cached} cached)", _prefill_step(engine, prompt, device, profile=True)[2])
        rows.append((n, miss, cached, hit))
        print(f"# prefill {n}: miss {miss:.2f} ms, hit ({cached} cached, {n - cached} computed) {hit:.2f} ms",
              flush=True)
    print("| prompt tokens | miss ms/step | cached tokens | hit ms/step | miss / hit |")
    print("|---:|---:|---:|---:|---:|")
    for n, miss, cached, hit in rows:
        print(f"| {n} | {miss:.2f} | {cached} | {hit:.2f} | {miss / hit:.2f} |")


class PhaseTimer:
    """Wall time of the runner's phases inside engine steps (synchronised on CUDA, so GPU time lands in its phase):
    `step` (decode / verify / prefill forward), `mtp` (the MTP drafter's forwards), `commit` (the rollback of
    rejected drafts); the rest of an engine step is host work (scheduling, sampling, acceptance, events)."""

    def __init__(self, engine: Engine, device: str):
        self.ms = {"step": 0.0, "mtp": 0.0, "commit": 0.0}
        self.runner = r = engine.runner
        self.names = ("step", "mtp_step", "commit_spec")
        for phase, name in zip(("step", "mtp", "commit"), self.names):
            setattr(r, name, self._wrap(getattr(r, name), phase, device))

    def unwrap(self) -> None:
        """Remove the timing wrappers (and their synchronisations)."""
        for name in self.names:
            vars(self.runner).pop(name, None)

    def _wrap(self, fn, phase: str, device: str):
        def timed(*a, **kw):
            _sync(device)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            _sync(device)
            self.ms[phase] += (time.perf_counter() - t0) * 1e3
            return out
        return timed


def spec_bench(model, tok, args) -> None:
    """Batch-`--batch` greedy decoding, plain vs `--speculative-tokens` k MTP drafts, CUDA graphs on: ms per engine
    step, tokens per step, ms per token and where a step's time goes (PhaseTimer), after an untimed pass."""
    k = args.speculative_tokens
    print("| k | batch | ms/step | tokens/step | ms/token | forward ms | MTP ms | commit ms | other host ms | "
          "acceptance |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for spec in (0, k):
        cfg = ServeConfig(device=args.device, dtype="bfloat16", max_num_seqs=max(args.batch),
                          max_model_len=args.prompt_len + 2 * args.new_tokens + 64, max_num_batched_tokens=2048,
                          enable_prefix_caching=False, cuda_graphs=args.device == "cuda",
                          cuda_graph_batches=list(args.batch), num_speculative_tokens=spec)
        engine = Engine(model, tok, cfg)
        engine.warmup()
        for b in args.batch:
            decode_ms(engine, b, args.prompt_len, args.new_tokens, tok.vocab_size)  # captures what is new
            timer = PhaseTimer(engine, args.device)
            names = ("k3:generation_tokens", "k3:spec_decode_num_draft_tokens", "k3:spec_decode_num_accepted_tokens")
            start = {}

            def on_start(timer=timer, start=start, names=names, engine=engine):  # after the prefill: decode steps only
                timer.ms = dict.fromkeys(timer.ms, 0.0)
                start.update({n: engine.metrics.get(n) for n in names})

            ms, steps = decode_ms(engine, b, args.prompt_len, args.new_tokens, tok.vocab_size, with_steps=True,
                                  on_start=on_start)
            tokens, *acc = (engine.metrics.get(n) - start[n] for n in names)
            tokens /= steps
            per = {p: v / steps for p, v in timer.ms.items()}
            print(f"| {spec} | {b} | {ms:.2f} | {tokens:.2f} | {ms / tokens:.2f} | {per['step']:.2f} | "
                  f"{per['mtp']:.2f} | {per['commit']:.2f} | {ms - sum(per.values()):.2f} | "
                  f"{acc[1] / acc[0] if acc[0] else float('nan'):.2f} |", flush=True)
            if args.profile:
                timer.unwrap()
                profile_decode(engine, b, args.prompt_len, tok.vocab_size, f"k={spec}")


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
    ap.add_argument("--prefill-lens", type=int, nargs="+", metavar="N", help="time eager prefill steps of these "
                    "prompt lengths (a miss and a prefix hit each) instead of the decode steps")
    ap.add_argument("--profile", action="store_true", help="with --prefill-lens: torch.profiler's top 15 ops and the "
                    "host waits of each prefill case; else: 16 profiled decode (or speculative) steps per mode and "
                    "batch (device busy time, the top 20 kernels and the top 15 host ops per step)")
    ap.add_argument("--speculative-tokens", type=int, default=0, metavar="K", help="time plain vs K MTP drafts at "
                    "each --batch (graphs on; needs a checkpoint with an MTP head, e.g. --ckpt runs/tiny/final): ms "
                    "per step, tokens per step and the step's phases (forward, MTP, commit, host)")
    args = ap.parse_args()
    if args.prefill_lens and min(args.prefill_lens) < 1:
        ap.error(f"--prefill-lens must be positive token counts, got {args.prefill_lens}")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("serve_step.py --device cuda needs a CUDA GPU; use --device cpu for the eager static-buffer path")
    name = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    what = (f"prefill lengths {args.prefill_lens}" if args.prefill_lens
            else f"prompt {args.prompt_len}, {args.new_tokens} tokens")
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {name}, torch "
          f"{torch.__version__}; {args.ckpt or args.model}, bf16, {what}")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt or _random_release(args.model, Path(tmp), args.device)
        model, _ = load_model(ckpt, device=args.device, dtype="bfloat16")
        tok = K3Tokenizer.from_file(ckpt)
    if args.speculative_tokens:
        spec_bench(model, tok, args)
        return
    if args.prefill_lens:
        top = max(args.prefill_lens)
        cfg = ServeConfig(device=args.device, dtype="bfloat16", max_num_seqs=2, max_model_len=top + 64,
                          max_num_batched_tokens=max(top, 64), enable_prefix_caching=True, cuda_graphs=False)
        print(f"# eager prefill steps, prefix caching on, max_num_batched_tokens {cfg.max_num_batched_tokens}")
        prefill_bench(Engine(model, tok, cfg), args.prefill_lens, tok.vocab_size, args.device, args.profile)
        return
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
            engine.runner.enable_static_steps(compile=graphs == "compiled")
        t_warm = time.perf_counter()
        engine.warmup()  # captures (and with compiled, compiles) the --batch buckets
        print(f"# graphs={graphs}: warm-up {time.perf_counter() - t_warm:.1f} s", flush=True)
        for b in args.batch:
            # a first pass per batch size compiles whatever is new for it (Triton specialises on sizes, graphs are
            # captured on first use); the second is timed
            decode_ms(engine, b, args.prompt_len, min(args.new_tokens, 8), tok.vocab_size)
            rows[(graphs, b)] = decode_ms(engine, b, args.prompt_len, args.new_tokens, tok.vocab_size)
            print(f"# graphs={graphs} batch={b}: {rows[(graphs, b)]:.2f} ms/step", flush=True)
            if args.profile:
                profile_decode(engine, b, args.prompt_len, tok.vocab_size, f"graphs={graphs}")
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
