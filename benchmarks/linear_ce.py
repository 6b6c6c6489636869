"""The LM head + cross-entropy: the fused chunked op (k3.kernels.loss.linear_cross_entropy) against the paths the
train loop had before it, forward and forward + backward, time and peak memory, at a pretrain preset's shapes.

    python benchmarks/linear_ce.py                        # CUDA: presets tiny and small, bf16 autocast
    python benchmarks/linear_ce.py --device cpu           # CPU: preset tiny (the default `k3 pretrain`), fp32
    python benchmarks/linear_ce.py --device cpu --preset debug --tokens 100 --reps 2     # smoke test

Shapes from the pretrain preset: N = batch_size * seq_len tokens (--tokens overrides), D = d_model, V = vocab_size
(tiny: 4096 x 128 x 4096; small: 16,384 x 768 x 32,768). Inputs: the normed hidden h [N, D] and the head weight
W [V, D] in fp32 (the residual stream and the parameters), random targets with a tenth of them -100; CUDA runs
under bf16 autocast as `k3 pretrain` does, the CPU in fp32.

Rows (each one loss, as the step pays twice: CE and MTP CE):
- `whole logits`: F.cross_entropy(F.linear(h, W).float(), t), the train loop's default path before (k3kernels/loss/
  naive.py);
- `checkpointed C`: k3.train.loop.chunked_cross_entropy over C-token chunks recomputed in the backward (the
  `train.loss_chunk_tokens = C` path; still used for a head that is not a plain nn.Linear);
- `fused C`: the fused op over C-token chunks (`default` marks k3.kernels.loss.default_chunk_tokens).
fwd: the loss with autograd recording, as a training step runs it (the fused op forms its gradients there, so its
fwd is nearly its fwd+bwd). fwd+bwd: the loss and the gradients of h and W. Times: CUDA events, the median of
--reps runs after warm-up; on a CPU the median (and the minimum, less disturbed by other processes) of --reps
wall-clock runs. Peak: CUDA max_memory_allocated above the inputs; on a CPU the growth of the peak resident set
during one fwd+bwd, each row in a fresh process (Linux /proc). rel: the largest relative RMS difference of the loss and both
gradients from `whole logits` in the same dtype. speedup / memory: `whole logits` over the row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--preset", action="append", default=None,
                    help="pretrain preset for the shapes, repeatable (default: tiny and small on CUDA, tiny on cpu)")
    ap.add_argument("--tokens", type=int, default=None, help="N, overriding the preset's batch_size * seq_len")
    ap.add_argument("--chunks", default="default",
                    help="comma-separated chunk sizes of the fused rows ('default' = default_chunk_tokens)")
    ap.add_argument("--checkpoint-chunk", type=int, default=None,
                    help="chunk of the checkpointed row (default: the fused default chunk; 0 leaves the row out)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per measurement (default 50 CUDA, 7 cpu)")
    ap.add_argument("--no-peak", action="store_true", help="leave the peak memory out (on a CPU: no child processes)")
    ap.add_argument("--peak-row", default=None, help=argparse.SUPPRESS)  # internal: one CPU peak in a fresh process
    return ap.parse_args(argv)


def setup(args, preset):
    """(N, D, V, h, W, t, autocast context factory) for a preset on the device."""
    import contextlib

    import torch

    from k3.cli.config import resolve_config

    cfg = resolve_config("pretrain", preset=preset)
    N = args.tokens or cfg.train.batch_size * cfg.data.seq_len
    D, V = cfg.model.d_model, cfg.model.vocab_size
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g).to(args.device).requires_grad_()
    w = (torch.randn(V, D, generator=g) * cfg.model.initializer_range * 10).to(args.device).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < 0.1] = -100
    t = t.to(args.device)
    cuda = args.device == "cuda"
    ac = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    return N, D, V, h, w, t, ac


def rows(args, N, V, h, w, t):
    """[(label, loss function)] of the benchmark's rows."""
    import torch.nn.functional as F

    from k3.kernels.loss import default_chunk_tokens, linear_cross_entropy, linear_cross_entropy_torch
    from k3.train.loop import chunked_cross_entropy

    dflt = default_chunk_tokens(V, h.device)
    out = [("whole logits", lambda: linear_cross_entropy_torch(h, w, t))]
    ck = dflt if args.checkpoint_chunk is None else args.checkpoint_chunk
    if ck:
        out.append((f"checkpointed {ck}",
                    lambda: chunked_cross_entropy(lambda x: F.linear(x, w), h[None], t[None], ck)))
    for c in args.chunks.split(","):
        size = dflt if c.strip() == "default" else int(c)
        label = f"fused {size}" + (" default" if size == dflt else "")
        out.append((label, lambda size=size: linear_cross_entropy(h, w, t, size)))
    return out


def cpu_peak_mib(args, preset: str, label: str) -> float:
    """Peak resident-set growth (MiB) of one fwd+bwd of a row, measured in a fresh process."""
    cmd = [sys.executable, __file__, "--device", "cpu", "--preset", preset, "--chunks", args.chunks,
           "--peak-row", label]
    if args.tokens:
        cmd += ["--tokens", str(args.tokens)]
    if args.checkpoint_chunk is not None:
        cmd += ["--checkpoint-chunk", str(args.checkpoint_chunk)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_mib"]


def peak_row(args) -> None:
    N, _, V, h, w, t, ac = setup(args, args.preset[0])
    fn = dict(rows(args, N, V, h, w, t))[args.peak_row]
    base = _reset_peak_rss_kib()
    with ac():
        loss = fn()
    loss.backward()
    print(json.dumps({"peak_mib": (_peak_rss_kib() - base) / 1024}))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def _reset_peak_rss_kib() -> int:
    """Reset the peak resident set to the current one (Linux clear_refs "5") and return it, KiB. getrusage's
    ru_maxrss cannot serve: a child inherits its parent's peak across fork and exec."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def _peak_rss_kib() -> int:
    return _status_kib("VmHWM")


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = args.device == "cuda"
    args.preset = args.preset or (["tiny", "small"] if cuda else ["tiny"])
    if args.peak_row is not None:
        return peak_row(args)
    reps = args.reps or (50 if cuda else 7)
    dev_name = torch.cuda.get_device_name() if cuda else f"cpu, {torch.get_num_threads()} threads"
    print(f"\nLM head + cross-entropy, one loss; {dev_name}, torch {torch.__version__}, {datetime.date.today()}")
    for preset in args.preset:
        N, D, V, h, w, t, ac = setup(args, preset)
        print(f"\npreset {preset}: N={N} D={D} V={V}, " + ("bf16 autocast" if cuda else "fp32"))
        print(f"{'path':<24} {'fwd ms':>9} {'fwd+bwd ms':>11} {'(min)':>9} {'peak MiB':>9} {'speedup':>8} "
              f"{'memory':>7} {'rel':>8}")
        ref = None
        base_ms = base_mib = None
        for label, fn in rows(args, N, V, h, w, t):
            def run(fn=fn, h=h, w=w, ac=ac, bwd=True):
                with ac():
                    loss = fn()
                if bwd:
                    h.grad = w.grad = None
                    loss.backward()
                return loss

            loss = run()
            got = [loss.detach().float(), h.grad.float(), w.grad.float()]
            ref = ref or got
            rel = max(((a - b).double().pow(2).mean().sqrt() / (a.double().pow(2).mean().sqrt() + 1e-30)).item()
                      for a, b in zip(ref, got))
            fwd, both = timed(lambda: run(bwd=False), reps, cuda), timed(run, reps, cuda)
            if cuda and not args.no_peak:
                h.grad = w.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
                run()
                torch.cuda.synchronize()
                mib = (torch.cuda.max_memory_allocated() - start) / 2**20
            elif not args.no_peak:
                mib = cpu_peak_mib(args, preset, label)
            else:
                mib = float("nan")
            if base_ms is None:  # the first row, `whole logits`
                base_ms, base_mib = both[0], mib
            print(f"{label:<24} {fwd[0]:>9.2f} {both[0]:>11.2f} {both[1]:>9.2f} {mib:>9.1f} "
                  f"{base_ms / both[0]:>7.2f}x {base_mib / max(mib, 1e-3):>6.1f}x {rel:>8.1e}")


def timed(fn, reps: int, cuda: bool) -> tuple[float, float]:
    """(median, minimum) ms of `reps` runs after two warm-up runs."""
    import torch

    for _ in range(2):
        fn()
    ms = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ms.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms), min(ms)


if __name__ == "__main__":
    main()
