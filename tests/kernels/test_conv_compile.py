"""The Triton short-conv kernels (k3kernels/conv/triton.py, forward and backward) and the RMSNorm kernels, gated and
plain (k3kernels/norm/triton.py) compile for the GPU (sm_90: Triton's front end, its LLVM back end and ptxas, without a GPU)
in the variants a launch can pick: widths, SiLU or not, packed or batch rows, fp32 / bf16 tensors (fp16 too for the
norm), fp32 or bf16 weights, the launch table's blocks and warps, and the norm's eps as fp64 (as inductor passes it)
without fp64 arithmetic. The interpreter that runs the CPU tests never type-checks a kernel the way the compiler
does, so this runs in processes of their own without it (sm90_compile.py, through conftest's `sm90_compile`), by
default as a covering subset (each value some variant gives a kernel's constexpr, argument type or launch option,
compiled at least once); every variant under `-m slow_compile`.
"""

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

_VARIANTS = r"""
import itertools, re
from k3.kernels.conv import triton as CV
from k3.kernels.norm import triton as NM

def aligned(fn, sig):  # pointers 16-byte aligned, as a launch specialises them
    return {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if sig[a].startswith("*")}

def no_fp64_arithmetic(ptx):
    f64 = re.findall(r"\b(?:add|sub|mul|fma|div|rsqrt|sqrt)\.[\w.]*f64", ptx)
    assert not f64, f64[:5]

for dt, wdt, W, silu, varlen in itertools.product(("bf16", "fp32"), ("fp32", "bf16"), (4, 3, 2), (True, False),
                                                  (False, True)):
    # without packed sequences the launch passes x itself in the unused seq_start slot
    seq = "*i32" if varlen else f"*{dt}"
    for kind, fn in (("fwd", CV._conv_fwd_kernel), ("bwd", CV._conv_bwd_kernel)):
        cfg = CV.LAUNCH[kind]
        consts = {"W": W, "SILU": silu, "VARLEN": varlen, "BT": cfg["BT"], "BC": cfg["BC"]}
        sig = {a: "constexpr" if a in consts else "i32" if a in ("T", "C") else "*fp32" if a == "dw_part"
               else seq if a == "seq_start" else f"*{wdt}" if a[0] == "w" else f"*{dt}" for a in fn.arg_names}
        variant(fn, sig, consts, {"num_warps": cfg["num_warps"]}, attrs=aligned(fn, sig))  # sm90_compile.py

for dt, eps, V, gate in itertools.product(("bf16", "fp32", "fp16"), ("fp32", "fp64"), (128, 100, 768),
                                          (True, False)):
    BV, BR = NM._blocks(V)
    for fn in (NM._norm_fwd_kernel, NM._norm_bwd_kernel):
        consts = {"V": V, "BV": BV, "BR": BR, "GATE": gate,
                  **({"TILES": NM._tiles(16384, BR)} if fn is NM._norm_bwd_kernel else {})}
        sig = {a: "constexpr" if a in consts else "i32" if a == "R" else eps if a == "eps" else "*fp32"
               if a in ("w", "dw_part") else f"*{dt}" for a in fn.arg_names}
        variant(fn, sig, consts, {"num_warps": NM.NUM_WARPS}, attrs=aligned(fn, sig),
                check=no_fp64_arithmetic if eps == "fp64" else None)
"""


def test_conv_and_norm_kernels_compile_for_sm90_with_every_value(sm90_compile):
    """Each constexpr value, argument type and launch option of the four kernels' variants, in a covering subset."""
    sm90_compile(_VARIANTS, "cover", timeout=600)


@pytest.mark.slow_compile
def test_conv_and_norm_kernels_compile_for_sm90_in_every_variant(sm90_compile):
    """Every variant: each combination of the flags and dtypes."""
    sm90_compile(_VARIANTS, "every", timeout=1800)
