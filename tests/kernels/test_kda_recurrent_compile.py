"""The recurrent KDA kernel (recurrent._recurrent_kda_kernel) compiles for the GPU (sm_90, Triton's front end,
without a GPU). The interpreter, which runs the CPU tests, never compiles it; compiled in processes of their own,
without the interpreter (sm90_compile.py, as test_kda_compile.py): by default a covering subset of the variants,
all of them under `-m slow_compile`.
"""

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

_VARIANTS = r"""
import itertools
import triton
from k3.kernels.kda.triton import recurrent as rec_mod
from k3.kernels.kda.triton import common

# compiled, the kernels' counted loops are tl.range itself (common.loop_range; a Python loop only under the interpreter)
assert common.loop_range is triton.language.range and not common.INTERPRETED

fn = rec_mod._recurrent_kda_kernel
TYPES = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "beta": "*bf16", "o": "*bf16", "cu_seqlens": "*i64",
         "slots": "*i32", "per_token": "*i32", "scale": "fp32", "lower_bound": "fp32"}
cases = list(itertools.product([(128, 128, 32), (100, 60, 32)], (True, False), ("pool", "per_token", "h0", "none")))
for (K, V, BV), t1, states in cases + [((128, 128, 64), True, "pool")]:  # + the decode step at BV 64
    varlen = v_first = states in ("per_token", "h0")
    pool = states in ("pool", "per_token")
    consts = {"H": 1, "HV": 2, "K": K, "V": V, "BK": 128, "BV": BV, "L2NORM": K == 128, "GATE": K == 128,
              "LOWER_BOUND_GATE": not t1, "HAS_A_LOG": t1, "HAS_DT_BIAS": True, "BETA_SIGMOID": K == 128,
              "HAS_H0": states != "none", "STORE_HT": not t1, "POOL": pool, "PER_TOKEN": states == "per_token",
              "VARLEN": varlen}
    if t1:  # a GPU launch turns integer arguments equal to 1 into constants: T at decode, the unit state stride
        consts["T"] = 1
    if states != "none":
        consts["s0_k" if v_first else "s0_v"] = 1
    sig = {a: "constexpr" if a in consts else TYPES.get(a, "*fp32" if a[0] in "ghAd" else "i32") for a in fn.arg_names}
    variant(fn, sig, consts, {"num_warps": 4})  # sm90_compile.py
"""


def test_recurrent_kernel_compiles_for_sm90_with_every_value(sm90_compile):
    """Each value that _VARIANTS gives the kernel, in a covering subset."""
    sm90_compile(_VARIANTS, "cover", timeout=600)


@pytest.mark.slow_compile
def test_recurrent_kernel_compiles_for_sm90(sm90_compile):
    """Pool, per-token, plain and no states (the last two varlen with V-first strides), K = V = 128 and K = 100 /
    V = 60, one token as a constant (a decode launch's specialisation) or a runtime T: every combination."""
    sm90_compile(_VARIANTS, "every", timeout=1800)
