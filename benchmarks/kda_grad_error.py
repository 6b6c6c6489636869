"""Gradient accuracy of `chunk_kda` for bf16 inputs: k3's Triton kernels (at their defaults and at other launch
settings) next to fla-core 0.6.0, both against a float64 reference on the same inputs.

Run on a CUDA machine (never in tests): `python benchmarks/kda_grad_error.py [--shape B,T,H,D ...]
[--set NAME.KEY=VALUE ...] [--no-fla]`. Each `--set` (as kda_tune.py's) adds one k3 row with that one LAUNCH entry
changed; the defaults are restored after it. Without a GPU it runs the k3 rows under Triton's interpreter with
fp32 inputs at a tiny shape (a smoke test of the script, not a measurement; the interpreter cannot run bf16 dots,
and with numpy >= 2.4 its loops need tests/kernels/conftest.py's patch).

Inputs as benchmarks/kda.py's (q, k, v ~ N(0, 1) bf16, fp32 log gates -5 sigmoid(z), beta in (0, 1)), with
use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5 for every row; loss = sum(o * do) with do ~ N(0, 1).
Reference: chunk_kda on the same values upcast to float64 (k3's PyTorch implementation, chunk.py, with its
hand-derived backward). Columns: relative RMS error (kda.md 6.1) of o and of the gradients of q, k, v, g, beta.
Why: a dot precision (LAUNCH[...]["PREC"]) is a speed / accuracy trade; fla's own error on the same inputs says
what accuracy users of the anchor already accept.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch

os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ["K3_KERNELS"] = "triton"
os.environ["K3_KDA_BWD"] = "triton"
if not torch.cuda.is_available():  # the CPU smoke test: the interpreter must be on before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import triton

from k3.kernels.kda import chunk_kda, triton_chunk, triton_chunk_bwd

SHAPES = [(1, 4096, 16, 128), (1, 2048, 32, 64)]  # the two head sizes, one sequence each
KW = {"use_qk_l2norm_in_kernel": True, "safe_gate": True, "lower_bound": -5.0}
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return ((ref - out).pow(2).mean().sqrt() / (ref.pow(2).mean().sqrt() + 1e-30)).item()


def inputs(B: int, T: int, H: int, D: int, dev: str, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(42)
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, D, generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    do = torch.randn(B, T, H, D, generator=gen)
    xs = [q.to(dev, dtype), k.to(dev, dtype), v.to(dev, dtype), g.to(dev), beta.to(dev, dtype)]
    return xs, do.to(dev, dtype)


def outputs(fn, xs: list[torch.Tensor], do: torch.Tensor) -> list[torch.Tensor]:
    """[o, dq, dk, dv, dg, dbeta] of fn on leaves copied from xs."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    o = fn(*leaves, **KW)[0]
    grads = torch.autograd.grad((o * do.to(o.dtype)).sum(), leaves)
    return [o.detach(), *grads]


def snapshot() -> list[dict]:
    return [{n: dict(e) for n, e in mod.LAUNCH.items()} for mod in (triton_chunk, triton_chunk_bwd)]


def restore(saved: list[dict]) -> None:
    for mod, launch in zip((triton_chunk, triton_chunk_bwd), saved, strict=True):
        for name, entry in launch.items():
            mod.LAUNCH[name].clear()
            mod.LAUNCH[name].update(entry)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", default=None, metavar="B,T,H,D",
                    help=f"repeatable; default {' '.join(','.join(map(str, s)) for s in SHAPES)}")
    ap.add_argument("--set", action="append", default=[], metavar="NAME.KEY=VALUE",
                    help="one extra k3 row with this LAUNCH entry (as kda_tune.py --set; repeatable, one row each)")
    ap.add_argument("--no-fla", action="store_true", help="k3 rows only")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else SHAPES
    if not cuda:
        shapes = [(1, 40, 1, 32)]
    fla_chunk = None
    if cuda and not args.no_fla:
        try:
            from fla.ops.kda import chunk_kda as fla_chunk
        except ImportError as e:
            ap.error(f"fla-core is not importable ({e}); install it into this environment or pass --no-fla")
    from kda_tune import set_launch  # benchmarks/ is the script's directory, so on sys.path

    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    device = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter, fp32 inputs: a smoke test)"
    print(f"# {when}, {device}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"## relative RMS error against float64 (chunk.py), {str(dtype).split('.')[-1]} inputs")
    print("| shape (B,T,H,D) | implementation | " + " | ".join(NAMES) + " |")
    print("|---|---|" + "---:|" * len(NAMES))
    for B, T, H, D in shapes:
        xs, do = inputs(B, T, H, D, dev, dtype)
        ref = outputs(chunk_kda, [x.double() for x in xs], do.double())
        rows = [("k3 (defaults)", chunk_kda, None)] + [(f"k3 --set {s}", chunk_kda, s) for s in args.set]
        if fla_chunk is not None:
            rows.append(("fla-core 0.6.0", fla_chunk, None))
        for label, fn, setting in rows:
            saved = snapshot()
            try:
                if setting:
                    set_launch(ap, setting)
                errs = [rel_rms(r, x) for r, x in zip(ref, outputs(fn, xs, do), strict=True)]
            finally:
                restore(saved)
            print(f"| ({B},{T},{H},{D}) | {label} | " + " | ".join(f"{e:.2e}" for e in errs) + " |", flush=True)
        del xs, do, ref
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
