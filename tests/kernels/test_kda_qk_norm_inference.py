"""An inference forward with use_qk_l2norm_in_kernel=True (no gradient wanted, no intermediate states): only the
rows' inverse L2 norms are computed (triton_l2norm.l2norm_rstd), and the intra and w/u kernels scale the rows of the
raw q and k they load (RSTD). Checked against the float64 recurrence on l2norm(q), l2norm(k), and against the path
that normalises q and k first (a forward with gradients), which must agree at rounding level.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

# after the skip; conftest imported the kernel modules under the interpreter on a CPU
from k3.kernels.kda import chunk_kda, l2norm, triton_chunk, triton_l2norm
from k3.kernels.testing import assert_close
from tests.kernels.test_kda_triton import GRAD_RATIOS, VARLEN_RATIOS, naive_varlen, ratio_for

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]

pytestmark = pytest.mark.usefixtures("triton_kda_backward")  # tests/kernels/conftest.py

CASES = [  # (B, T, H, HV, D, chunk size, safe gate, cu_seqlens)
    (1, 70, 1, 2, 32, 64, True, None),  # GVA: key rows shared by two value heads; a partial last chunk
    (2, 50, 2, 2, 60, 32, False, None),  # K = 60: masked columns; two key heads
    (1, 80, 1, 1, 64, 64, True, [0, 15, 15, 80]),  # varlen with an empty sequence
]
IDS = [f"B{c[0]}-T{c[1]}-H{c[2]}-HV{c[3]}-D{c[4]}-BT{c[5]}{'-varlen' if c[7] else ''}" for c in CASES]


def inputs(B, T, H, HV, D, dtype, N):
    """Raw q, k with rows of norm far from 1 (and differing per row), so that a missing or misplaced scale shows."""
    torch.manual_seed(0)
    q, k = 3 * torch.rand(B, T, H, D) - 1, 2 * torch.rand(B, T, H, D) * torch.rand(B, T, H, 1)
    v = torch.rand(B, T, HV, D)
    g = F.logsigmoid(torch.randn(B, T, HV, D)).clamp_min(-5.0)
    beta = torch.randn(B, T, HV).sigmoid()
    h0 = torch.randn(N, HV, D, D)
    return [x.to(DEV, dtype) for x in (q, k, v)] + [g.to(DEV), beta.to(DEV, dtype), h0.to(DEV)]


@pytest.fixture
def norm_launches(monkeypatch):
    """STORE_Y of each L2-norm forward launch (True: the normalised copy is written), and RSTD of each intra and
    w/u launch, in order."""
    log = []

    def spy(module, name, key):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, type("Spy", (), {"__getitem__": lambda _, grid: lambda *a, **kw: (
            log.append((name, kw[key])), real[grid](*a, **kw))[1]})())

    spy(triton_l2norm, "_l2norm_fwd_kernel", "STORE_Y")
    spy(triton_chunk, "_intra_sub_kernel", "RSTD")
    spy(triton_chunk, "_wu_kernel", "RSTD")
    return log


def run(xs, BT, safe, cu, **kw):
    return chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=BT, safe_gate=safe,
                     lower_bound=-5.0 if safe else None, use_qk_l2norm_in_kernel=True,
                     cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV), **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("B,T,H,HV,D,BT,safe,cu", CASES, ids=IDS)
def test_inference_forward_scales_raw_rows(B, T, H, HV, D, BT, safe, cu, dtype, norm_launches):
    xs = inputs(B, T, H, HV, D, dtype, B if cu is None else len(cu) - 1)
    with torch.no_grad():
        o, s = run(xs, BT, safe, cu)
    assert norm_launches == [("_l2norm_fwd_kernel", False)] * 2 + [("_intra_sub_kernel", True), ("_wu_kernel", True)]
    q, k, v, g, beta, h0 = (x.double().cpu() for x in xs)
    want_o, want_s = naive_varlen(l2norm(q), l2norm(k), v, g, beta, h0, cu)
    ratios = VARLEN_RATIOS if cu else GRAD_RATIOS
    assert_close("o", want_o, o, ratio_for(dtype, ratios[0]))
    assert_close("ht", want_s, s, ratio_for(dtype, ratios[1]))
    # the same forward with gradients wanted normalises q and k first (the backward needs them): the same outputs
    # at rounding level (bf16: its q and k are rounded after the norm, here before it)
    norm_launches.clear()
    leaves = [x.clone().requires_grad_(i == 2) for i, x in enumerate(xs)]
    o2, s2 = run(leaves, BT, safe, cu)
    assert norm_launches == [("_l2norm_fwd_kernel", True)] * 2 + [("_intra_sub_kernel", False), ("_wu_kernel", False)]
    assert_close("o vs the normalising path", o2.detach().double(), o, 1e-6 if dtype == torch.float32 else 0.005)
    assert_close("ht vs the normalising path", s2.detach().double(), s, 1e-6 if dtype == torch.float32 else 0.005)


def test_intermediate_states_and_the_output_kernel_normalise_first(norm_launches, monkeypatch):
    """return_intermediate_states normalises q and k first (its output kernel reads q); an inference forward whose
    output is not fused into the scan (LAUNCH["scan"]["OUTPUT_FROM"] above its programs) normalises them inside the
    pipeline from the inverse norms. Both as the recurrence. LAUNCH["intra"]["QK_RSTD"] off: normalised first."""
    B, T, H, HV, D, BT, safe, cu = CASES[0]
    xs = inputs(B, T, H, HV, D, torch.float32, B)
    q, k, v, g, beta, h0 = (x.double().cpu() for x in xs)
    want_o, want_s = naive_varlen(l2norm(q), l2norm(k), v, g, beta, h0, cu)
    with torch.no_grad():
        o, s, _h = run(xs, BT, safe, cu, return_intermediate_states=True)
    assert norm_launches == [("_l2norm_fwd_kernel", True)] * 2 + [("_intra_sub_kernel", False), ("_wu_kernel", False)]
    assert_close("o (intermediate states)", want_o, o, GRAD_RATIOS[0])
    assert_close("ht (intermediate states)", want_s, s, GRAD_RATIOS[1])
    norm_launches.clear()
    monkeypatch.setitem(triton_chunk.LAUNCH["scan"], "OUTPUT_FROM", 10**9)
    with torch.no_grad():
        o, s = run(xs, BT, safe, cu)
    assert norm_launches == [("_l2norm_fwd_kernel", False)] * 2 + [("_intra_sub_kernel", False), ("_wu_kernel", False)]
    assert_close("o (output kernel)", want_o, o, GRAD_RATIOS[0])
    assert_close("ht (output kernel)", want_s, s, GRAD_RATIOS[1])
    norm_launches.clear()  # switched off: normalised copies, as a forward with gradients
    monkeypatch.setitem(triton_chunk.LAUNCH["intra"], "QK_RSTD", False)
    with torch.no_grad():
        run(xs, BT, safe, cu)
    assert norm_launches == [("_l2norm_fwd_kernel", True)] * 2 + [("_intra_sub_kernel", False), ("_wu_kernel", False)]


def test_l2norm_rstd_matches_float64():
    x = torch.randn(3, 5, 2, 60, device=DEV) * torch.rand(3, 5, 2, 1, device=DEV) * 4
    want = x.double().pow(2).sum(-1).add(triton_l2norm.L2NORM_EPS).rsqrt().reshape(-1)
    assert_close("rstd", want.cpu(), triton_l2norm.l2norm_rstd(x).cpu(), 1e-6)
    assert triton_l2norm.l2norm_rstd(x[:0]).shape == (0,)
