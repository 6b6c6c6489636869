"""Gradient accuracy of `chunk_kda` for bf16 inputs: k3's Triton kernels (at their defaults and at other launch
settings) next to fla-core 0.6.0, both against a float64 reference on the same inputs.

Run on a CUDA machine (never in tests): `python benchmarks/repro/kda_grad_error.py [--shape B,T,H,D ...]
[--set NAME.KEY=VALUE ...] [--no-fla]`. Each `--set` (as kda_tune.py's) adds one k3 row with that one LAUNCH entry
changed; the defaults are restored after it.

Inputs, flags and the error measure are benchmarks/kda.py's (chunk_inputs, KW, rel_rms: q, k, v ~ N(0, 1) bf16,
fp32 log gates -5 sigmoid(z), beta in (0, 1); use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5);
loss = sum(o * do) with do ~ N(0, 1).
Reference: chunk_kda on the same values upcast to float64 (k3's PyTorch implementation, chunk_torch.py, with its
hand-derived backward). Columns: relative RMS error (kda.md 6.1) of o and of the gradients of q, k, v, g, beta.
Why: a dot precision (LAUNCH[...]["PREC"]) is a speed / accuracy trade; fla's own error on the same inputs says
what accuracy users of the anchor already accept.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ["K3_KERNELS"] = "triton"
os.environ["K3_KDA_BWD"] = "triton"

import torch
import triton

from k3.kernels.kda import chunk_kda
from k3.kernels.kda.triton.launch import LAUNCH

SHAPES = [(1, 4096, 16, 128), (1, 2048, 32, 64)]  # the two benchmark head sizes, one sequence each
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def outputs(fn, xs: list[torch.Tensor], do: torch.Tensor, kw: dict) -> list[torch.Tensor]:
    """[o, dq, dk, dv, dg, dbeta] of fn(*xs, **kw) on leaves copied from xs."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    o = fn(*leaves, **kw)[0]
    grads = torch.autograd.grad((o * do.to(o.dtype)).sum(), leaves)
    return [o.detach(), *grads]


def snapshot() -> dict[str, dict]:
    return {n: dict(e) for n, e in LAUNCH.items()}


def restore(saved: dict[str, dict]) -> None:
    for name, entry in saved.items():
        LAUNCH[name].clear()
        LAUNCH[name].update(entry)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", default=None, metavar="B,T,H,D",
                    help=f"repeatable; default {' '.join(','.join(map(str, s)) for s in SHAPES)}")
    ap.add_argument("--set", action="append", default=[], metavar="NAME.KEY=VALUE",
                    help="one extra k3 row with this LAUNCH entry (as kda_tune.py --set; repeatable, one row each)")
    ap.add_argument("--no-fla", action="store_true", help="k3 rows only")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for kda.py and kda_tune.py
    from kda import KW, chunk_inputs, rel_rms
    from kda_tune import set_launch

    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the Triton kernels at bf16); the CPU tests cover the kernels under the interpreter")
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else SHAPES
    fla_chunk = None
    if not args.no_fla:
        try:
            from fla.ops.kda import chunk_kda as fla_chunk
        except ImportError as e:
            ap.error(f"fla-core is not importable ({e}); install it into this environment or pass --no-fla")
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# {when}, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("## relative RMS error against float64 (chunk.py), bf16 inputs")
    print("| shape (B,T,H,D) | implementation | " + " | ".join(NAMES) + " |")
    print("|---|---|" + "---:|" * len(NAMES))
    for B, T, H, D in shapes:
        torch.manual_seed(42)
        xs = chunk_inputs(B, T, H, D)
        do = torch.randn_like(xs[2])
        ref = outputs(chunk_kda, [x.double() for x in xs], do.double(), KW)
        rows = [("k3 (defaults)", chunk_kda, None)] + [(f"k3 --set {s}", chunk_kda, s) for s in args.set]
        if fla_chunk is not None:
            rows.append(("fla-core 0.6.0", fla_chunk, None))
        for label, fn, setting in rows:
            saved = snapshot()
            try:
                if setting:
                    set_launch(ap, setting)
                errs = [rel_rms(r, x) for r, x in zip(ref, outputs(fn, xs, do, KW), strict=True)]
            finally:
                restore(saved)
            print(f"| ({B},{T},{H},{D}) | {label} | " + " | ".join(f"{e:.2e}" for e in errs) + " |", flush=True)
        del xs, do, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
