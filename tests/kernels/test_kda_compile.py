"""The Triton KDA backward kernels, the forward's intra, solve, w/u, scan and output kernels, and the gate compile for
the GPU (sm_90, Triton's front end and ptxas, without a GPU; at the launch's num_warps where it sets one) in the
variants a launch can pick: the exact and safe diagonal paths, each dot precision, fp32 or bf16 stored states,
varlen or not, fp64 float scalars (as inductor passes them).

The interpreter, which runs the CPU tests, executes kernels as Python and never type-checks them the way the
compiler does: a loop variable reused with another type (a `tl.static_range` index and a runtime `range` one) ran on
the CPU and failed to compile on the H200. Compiled in processes of their own, without the interpreter
(sm90_compile.py), one a core. By default a covering subset: each value that any variant gives a kernel's
constexpr, argument type or launch option, compiled at least once (41 of the 245 variants: 60 s on 2 cores with an
empty Triton cache); every combination under `-m slow_compile` (213 s).
"""

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

_VARIANTS = r"""
import itertools, re
from k3.kernels.kda.triton import chunk_bwd as B
from k3.kernels.kda.triton import chunk_fwd as F
from k3.kernels.kda.triton import gate as G
from k3.kernels.kda.triton import launch as L

HALF = {"q", "k", "v", "Aqk", "Mm", "w", "u", "vnew", "do", "dv", "dq_out", "dk_out"}  # beta: fp32 (the wrapper's)
SCALARS = {"scale": "fp32", "shift": "fp32", "g_floor": "fp32", "lower_bound": "fp32", "T": "i32",
           "NT": "i32", "T_all": "i32", "part_stride": "i32", "aqk_stride": "i32"}
INDEX = {"chunk_indices", "cu_seqlens", "chunk_offsets", "g_ok"}  # int32 pointers

def compile_(fn, consts, num_warps, half=(), num_stages=None, all_fp32=False, scalars=SCALARS, check=None):
    defaults = {"KSPLIT": 1, "Q_RSTD": False, "AQK_PARTS": 1}  # the intra kernel unsplit, q normalised, Aqk whole
    consts = {**{k: v for k, v in defaults.items() if k in fn.arg_names}, **consts}
    sig = {a: "constexpr" if a in consts else scalars.get(a) or ("*i32" if a in INDEX else "*bf16" if not all_fp32
           and (a in HALF or a in half) else "*fp32") for a in fn.arg_names}
    # pointers 16-byte aligned, as a launch specialises them: the pipelined (num_stages > 1) loops then compile to
    # the cp.async path the GPU runs (without the hint they compile as at 1 stage)
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if sig[a].startswith("*")}
    opts = {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {})}
    variant(fn, sig, consts, opts, attrs=aligned, check=check)  # sm90_compile.py

shape = {"H": 1, "HV": 2, "K": 32, "BT": 64}
for varlen in (False, True):
    for prec in L.INTER_PRECISIONS:
        kv = {**shape, "V": 32, "BK": 32, "BV": 32, "VARLEN": varlen, "PREC": prec}
        for states in ((), ("hbuf", "dhs", "dvn")):  # fp32 or bf16 states, state gradients and dv_new
            for split in (False, True):  # the state gradient whole or in two K halves (K > 128)
                for dht in (False, True):  # the final state's gradient given or not (dh0 stored with it)
                    compile_(B._bwd_scan_kernel, {**kv, "BK": 16 if split else 32, "SPLIT": split, "HAS_DHT": dht,
                                                  "STORE_DH0": dht}, 4, states,
                             num_stages=L.LAUNCH["bwd_scan"]["num_stages"])
            for early in (0, 1, 2):  # loads issued sooner (the kernel's EARLY)
                compile_(B._bwd_inter_kernel, {**{k: v for k, v in kv.items() if k != "BK"}, "BKB": 16,
                                               "EARLY": early}, 4, states)
        for safe in (True, False):
            for bk in (16, 32):  # two K blocks of K = 32, or one
                intra_bwd = {**shape, "V": 32, "BK": bk, "BV": 32, "BC": 16, "NC": 4, "SAFE": safe, "VARLEN": varlen,
                             "PREC": "bf16x3", "OFF": prec}
                opts = L.launch_opts("bwd_intra")
                # the L2 norm's backward: whole with one K block (NORM), q's from the output with two (Q_NORM_OUT)
                for norm, q_out in ((False, False), (True, False)) if bk == 32 else ((False, False), (False, True)):
                    compile_(B._bwd_intra_kernel, {**intra_bwd, "NORM": norm, "Q_NORM_OUT": q_out}, **opts)
    compile_(B._bwd_dg_kernel, {"HV": 2, "K": 32, "BK": 16, "BT": 64, "VARLEN": varlen},
             L.LAUNCH["bwd_dg"]["num_warps"])
    for store_qg in (False, True):  # w / u, kg (and the backward recompute's qg)
        compile_(F._wu_kernel, {**shape, "V": 32, "BK": 32, "BV": 32, "STORE_QG": store_qg, "VARLEN": varlen,
                                "PREC": "tf32"}, 4, ("kg", "qg"))
    if not varlen:  # the gate, both directions, every flag
        for has_a, has_bias, lower in itertools.product((True, False), repeat=3):
            flags = {"HV": 2, "K": 32, "BK": 32, "BT": 64, "HAS_A": has_a, "HAS_BIAS": has_bias, "LOWER": lower}
            compile_(G._gate_fwd_kernel, flags, 4, ("z",))
            compile_(G._gate_bwd_kernel, flags, 4, ("z", "dz"))
    for safe, store_akk, check, qg in itertools.product((True, False), repeat=4):  # the forward's intra kernel
        intra = {**shape, "BK": 32, "BC": 16, "NC": 4, "SAFE": safe, "STORE_AKK": store_akk, "CHECK_G": check,
                 "STORE_QG": qg, "VARLEN": varlen, "PREC": "tf32"}
        compile_(F._intra_sub_kernel, intra, L.intra_opts(32)["num_warps"], ("qg",))
    compile_(F._intra_sub_kernel, intra, L.intra_opts(128)["num_warps"], ("qg",))  # the K > 64 warps too
    compile_(F._intra_sub_kernel, {**intra, "BK": 16, "KSPLIT": 2, "Q_RSTD": True}, L.intra_opts(16)["num_warps"],
             ("qg",))  # in K halves, q's rows scaled by its rstd (an inference forward)
    for output, half, store in itertools.product((True, False), repeat=3):  # the state scan: with the output,
        if not (output or store):  # storing the states, or both (a training forward that keeps them)
            continue
        scan = {**shape, "V": 32, "BK": 32, "BV": 32, "HAS_H0": True, "STORE_HT": True, "OUTPUT": output,
                "STORE_STATES": store, "VARLEN": varlen, "PREC": "tf32"}
        halves = ("kg", "qg", "o") + (("hbuf",) if half else ())
        compile_(F._scan_kernel, scan, L.LAUNCH["scan"]["num_warps"], halves, L.LAUNCH["scan"]["num_stages"])
        if output and not store:  # Aqk as the K split's two fp16 partial sums (an inference forward)
            compile_(F._scan_kernel, {**scan, "AQK_PARTS": 2}, L.LAUNCH["scan"]["num_warps"], halves,
                     L.LAUNCH["scan"]["num_stages"])
        if not varlen:  # a time segment of each sequence (bounds as pairs: segments.py)
            compile_(F._scan_kernel, {**scan, "VARLEN": 2}, L.LAUNCH["scan"]["num_warps"], halves,
                     L.LAUNCH["scan"]["num_stages"])
    for beta_rows, parts in ((True, 1), (False, 1), (False, 2)):  # from Akk (a training forward) or from L (in two
        # partial sums with the intra kernel's K split)
        compile_(F._solve_kernel, {"HV": 2, "BT": 64, "BC": 16, "NC": 4, "BETA": beta_rows, "VARLEN": varlen,
                                   "PREC": "tf32", "PARTS": parts}, L.LAUNCH["solve"]["num_warps"], ("Mout",))
    for parts in (1, 2):  # the output from stored states, Aqk whole or in two partial sums
        compile_(F._output_kernel, {**shape, "V": 32, "BK": 32, "BV": 32, "VARLEN": varlen, "PREC": "tf32",
                                    "AQK_PARTS": parts}, L.LAUNCH["output"]["num_warps"], ("o", "hbuf"))
for prec in ("tf32x3", "tf32"):  # fp32 inputs under K3_KDA_FP32_DOTS: every pointer fp32, every dot at prec
    kv = {**shape, "V": 32, "BK": 32, "BV": 32, "VARLEN": False, "PREC": prec}
    compile_(B._bwd_scan_kernel, {**kv, "SPLIT": False, "HAS_DHT": True, "STORE_DH0": True}, 4,
             num_stages=L.LAUNCH["bwd_scan"]["num_stages"], all_fp32=True)
    compile_(B._bwd_inter_kernel, {**{k: v for k, v in kv.items() if k != "BK"}, "BKB": 16, "EARLY": 0}, 8,
             all_fp32=True)
    for bk, norm in ((32, True), (16, False)):  # NORM, then Q_NORM_OUT
        compile_(B._bwd_intra_kernel, {**shape, "V": 32, "BK": bk, "BV": 32, "BC": 16, "NC": 4, "SAFE": True,
                                       "VARLEN": False, "PREC": prec, "OFF": prec, "NORM": norm,
                                       "Q_NORM_OUT": not norm}, 1, all_fp32=True)
    compile_(F._wu_kernel, {**kv, "STORE_QG": True}, 4, all_fp32=True)
    compile_(F._scan_kernel, {**kv, "HAS_H0": True, "STORE_HT": True, "OUTPUT": True, "STORE_STATES": True}, 4,
             num_stages=L.LAUNCH["scan"]["num_stages"], all_fp32=True)
    compile_(F._intra_sub_kernel, {**shape, "BK": 32, "BC": 16, "NC": 4, "SAFE": True, "STORE_AKK": True,
                                   "CHECK_G": True, "STORE_QG": True, "VARLEN": False, "PREC": prec}, 1, all_fp32=True)
    compile_(F._solve_kernel, {"HV": 2, "BT": 64, "BC": 16, "NC": 4, "BETA": True, "VARLEN": False, "PREC": prec,
                               "PARTS": 1}, 1, all_fp32=True)
# float scalars as fp64, as inductor launches a kernel inside torch.compile (torch 2.11): each kernel takes them as
# fp32 at entry (_f32), so it compiles (else the intra kernel's diagonal block fails: "Both operands must be same
# dtype") and no tile arithmetic runs in fp64
F64 = {**SCALARS, "scale": "fp64", "shift": "fp64", "g_floor": "fp64", "lower_bound": "fp64"}


def no_fp64_arithmetic(ptx):
    f64 = re.findall(r"\b(?:add|sub|mul|fma|div|ex2)\.[\w.]*f64", ptx)
    assert not f64, f64[:5]

kv = {**shape, "V": 32, "BK": 32, "BV": 32, "VARLEN": False, "PREC": "tf32"}
gate = {"HV": 2, "K": 32, "BK": 32, "BT": 64, "HAS_A": True, "HAS_BIAS": True, "LOWER": True}
for fn, consts, warps in ((F._intra_sub_kernel, {**shape, "BK": 32, "BC": 16, "NC": 4, "SAFE": True, "STORE_AKK": True,
                                                 "CHECK_G": True, "STORE_QG": True, "VARLEN": False, "PREC": "tf32"}, 1),
                          (F._wu_kernel, {**kv, "STORE_QG": True}, 4), (F._output_kernel, kv, 4),
                          (B._bwd_inter_kernel, {**{k: v for k, v in kv.items() if k != "BK"}, "BKB": 16,
                                                 "EARLY": 0}, 8),
                          (B._bwd_intra_kernel, {**shape, "V": 32, "BK": 32, "BV": 32, "BC": 16, "NC": 4,
                                                 "SAFE": True, "VARLEN": False, "PREC": "tf32", "OFF": "tf32",
                                                 "NORM": True, "Q_NORM_OUT": False}, 1),
                          (G._gate_fwd_kernel, gate, 4), (G._gate_bwd_kernel, gate, 4)):
    compile_(fn, consts, warps, scalars=F64, check=no_fp64_arithmetic)
"""


def test_kernels_compile_for_sm90_with_every_value(sm90_compile):
    """Each constexpr value, argument type and launch option of every kernel's variants, in a covering subset."""
    sm90_compile(_VARIANTS, "cover", timeout=600)


@pytest.mark.slow_compile
def test_backward_kernels_compile_for_sm90_in_every_variant(sm90_compile):
    """Every variant: each combination of the flags (245 compiles)."""
    sm90_compile(_VARIANTS, "every", timeout=1800)


def test_the_covering_subset_keeps_every_value():
    """sm90_compile.cover on 2 x 2 x 3 flag combinations of one kernel: 3 variants, together every flag value."""
    import itertools
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("sm90_compile", Path(__file__).with_name("sm90_compile.py"))
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)

    def kernel():
        pass

    variants = [(kernel, {"x": "*fp32", "A": "constexpr", "B": "constexpr"}, {"A": a, "B": b}, {"num_warps": w}, None,
                 None) for a, b, w in itertools.product((0, 1), (0, 1), (1, 2, 4))]
    chosen = harness.cover(variants)
    assert len(chosen) == 3
    for flag in ("A", "B"):
        assert {variants[i][2][flag] for i in chosen} == {0, 1}
    assert {variants[i][3]["num_warps"] for i in chosen} == {1, 2, 4}
