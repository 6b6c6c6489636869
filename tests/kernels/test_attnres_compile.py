"""The fused Block AttnRes kernels (k3kernels/attnres/triton.py) compile for the GPU (sm_90: Triton's front end, its LLVM
back end and ptxas, without a GPU; sm90_compile.py) with the tiles and warps their launches pick: k3-small's width
(768, 16-divisible, as a launch specialises it), K3's (7168: one token a tile at 16 warps) and an odd one (100), the
sources as a tuple of 1, 2, 5 or 9 pointers in bf16, fp32, fp16 or mixed (an fp32 embedding among bf16 sources, the
model under autocast), and eps as fp64 (as inductor passes float scalars) without fp64 arithmetic in the tiles.

The interpreter, which runs the CPU tests, never type-checks kernels as the compiler does. The bounded form CI runs:
a covering subset, every value of every variant compiled at least once (here that is all 8 variants, each holding a
value no other gives: ~14 s of one core with an empty Triton cache); `-m slow_compile` compiles every variant too.
"""

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

_VARIANTS = r"""
import re
from k3.kernels.attnres import triton as A

SOURCES = {"bf16": ("bf16",), "fp32": ("fp32",), "fp16": ("fp16",), "mixed": ("fp32", "bf16")}


def no_fp64_arithmetic(ptx):
    f64 = re.findall(r"\b(?:add|sub|mul|fma|div|rsqrt|ex2)\.[\w.]*f64", ptx)
    assert not f64, f64[:5]


def compile_(kind, s, dtypes, d, eps="fp32", check=None):
    fn = A._attnres_fwd_kernel if kind == "fwd" else A._attnres_bwd_kernel
    types = SOURCES[dtypes]
    vs = tuple("*" + types[min(i, len(types) - 1)] for i in range(s))  # the first source's dtype, then the rest's
    bt, bd, warps = A._tile(kind, d, 16384)  # k3-small's B * T tokens
    consts = {"S": s, "BT": bt, "BD": bd, **({"TILES": A.LAUNCH["bwd"]["tiles"]} if kind == "bwd" else {})}
    sig = {"vs": vs, "dvs": vs, "nw_ptr": "*fp32", "pw_ptr": "*fp32", "x_ptr": vs[0], "dx_ptr": vs[0],
           "dq_ptr": "*fp32", "N": "i32", "D": "i32", "eps": eps}
    sig = {a: "constexpr" if a in consts else sig[a] for a in fn.arg_names}
    # pointers 16-byte aligned and D 16-divisible where it is, as a launch specialises them
    attrs = {}
    for i, a in enumerate(fn.arg_names):
        if isinstance(sig[a], tuple):
            attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(len(sig[a]))})
        elif sig[a].startswith("*") or (a == "D" and d % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    variant(fn, sig, consts, {"num_warps": warps}, attrs=attrs, check=check)  # sm90_compile.py


for kind in ("fwd", "bwd"):
    compile_(kind, 2, "bf16", 768, eps="fp64", check=no_fp64_arithmetic)
    for s, dtypes, d in ((9, "mixed", 768), (1, "fp32", 7168), (5, "fp16", 100)):
        compile_(kind, s, dtypes, d)
"""


def test_attnres_kernels_compile_for_sm90_with_every_value(sm90_compile):
    """Each source count, dtype mix, width's tile, warp count and the fp64 eps, in a covering subset."""
    sm90_compile(_VARIANTS, "cover", timeout=300)


@pytest.mark.slow_compile
def test_attnres_kernels_compile_for_sm90_in_every_variant(sm90_compile):
    sm90_compile(_VARIANTS, "every", timeout=900)
