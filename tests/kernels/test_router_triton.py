"""Fused Triton router top-K and QB histogram (k3kernels/moe/triton_router.py) vs the torch twins (architecture.md 9).

Twins: k3.model.moe.Router (selection: stable descending sort of scores + bias, lowest-index tie-break; weights
renormalised from the unbiased scores) and k3.train.balance.qb_histogram_counts. Indices and counts must be equal
exactly; scores within 1e-6 abs of the float64 sigmoid; weights and gradients rel-RMS < 1e-5 against float64
autograd (kda.md 6.1 style: max abs error <= 1e-6 passes outright). Inputs with many exact ties come from logits on
a coarse grid. On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1 while importing the module).
"""

import importlib
import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

CUDA = torch.cuda.is_available()


# triton and the kernel modules were imported under the interpreter by tests/kernels/conftest.py

from k3.kernels.moe.triton_router import qb_histogram_triton, router_select_triton, router_topk_triton
from k3.kernels.testing import assert_close
from k3.model.moe import Router
from k3.train.balance import qb_default_range, qb_histogram_counts

DEV = "cuda" if CUDA else "cpu"
CASES = [(37, 24, 1), (37, 24, 2), (37, 24, 4), (9, 7, 4), (16, 64, 4)]  # (N, E, K): E not a power of two mostly


pytestmark = pytest.mark.usefixtures("triton_cpu")  # tests/kernels/conftest.py




def make_logits(n, e, tied):
    """Gaussian logits, or (tied) logits on the grid {-1, -0.5, ..., 1} so most rows hold exactly equal scores."""
    if tied:
        return (torch.randint(-2, 3, (n, e)) * 0.5).to(DEV)
    return torch.randn(n, e).to(DEV)


def make_bias(e, tied):
    """Small random bias, or (tied) a bias on a 0.125 grid, so equal scores stay exactly equal after adding it."""
    if tied:
        return (torch.randint(-1, 2, (e,)) * 0.125).to(DEV)
    return (0.05 * torch.randn(e)).to(DEV)


def twin_select(scores, bias, k, rsf):
    """Router.forward's selection and weights (same ops, any dtype): stable sort, lowest index first on ties."""
    idx = torch.sort(scores.detach() + bias.to(scores.dtype), dim=-1, descending=True, stable=True).indices[:, :k]
    sel = scores.gather(1, idx)
    return idx, sel / sel.sum(-1, keepdim=True) * rsf


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n,e,k", CASES)
def test_select_equals_router_module(n, e, k, tied):
    """router_select_triton on the Router's own scores gives its indices exactly, and its weights."""
    router = Router(8, e, k, routed_scaling_factor=1.5).to(DEV)
    router.e_score_correction_bias.copy_(make_bias(e, tied))
    x = torch.randn(n, 8, device=DEV)
    if tied:  # make whole groups of experts score identically
        router.weight.data[1::2] = router.weight.data[0::2][: router.weight.shape[0] // 2]
    scores, idx_ref, w_ref = router(x)
    idx, w = router_select_triton(scores.detach(), router.e_score_correction_bias, k, 1.5)
    assert idx.dtype == torch.int64 and torch.equal(idx, idx_ref)
    assert_close("weights", w_ref, w)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n,e,k", CASES)
def test_topk_matches_twin_values_and_gradients(n, e, k, tied):
    logits = make_logits(n, e, tied).requires_grad_(True)
    bias = make_bias(e, tied)
    scores, idx, w = router_topk_triton(logits, bias, k, 2.0)
    assert scores.dtype == torch.float32 and w.dtype == torch.float32
    s_f64 = torch.sigmoid(logits.detach().double().cpu())
    assert (scores.detach().cpu().double() - s_f64).abs().max().item() < 1e-6
    # selection exactly as the Router would make it from these scores (ties included)
    idx_ref, _ = twin_select(scores.detach(), bias, k, 2.0)
    assert torch.equal(idx, idx_ref)
    # values and gradients against float64 autograd through sigmoid, gather and renormalisation, on the same picks
    x64 = logits.detach().double().cpu().requires_grad_(True)
    s_ref = torch.sigmoid(x64)
    sel = s_ref.gather(1, idx.cpu())
    w64 = sel / sel.sum(-1, keepdim=True) * 2.0
    assert_close("weights", w64, w)
    d_s, d_w = torch.randn(n, e), torch.randn(n, k)
    (scores * d_s.to(DEV)).sum().add((w * d_w.to(DEV)).sum()).backward()
    ((s_ref * d_s.double()).sum() + (w64 * d_w.double()).sum()).backward()
    assert_close("d logits", x64.grad, logits.grad)


def test_strided_logits():
    """Logits that are a column slice of a wider tensor (row stride != E) give the same result as a contiguous copy."""
    wide = torch.randn(11, 40, device=DEV)
    logits, bias = wide[:, 3:27], make_bias(24, False)
    s1, i1, w1 = router_topk_triton(logits, bias, 4)
    s2, i2, w2 = router_topk_triton(logits.contiguous(), bias, 4)
    assert torch.equal(s1, s2) and torch.equal(i1, i2) and torch.equal(w1, w2)
    assert torch.equal(qb_histogram_triton(s1, bias, 4, 32, -1.5, 1.5), qb_histogram_counts(s1, bias, 4, 32, -1.5, 1.5))


def test_select_gradient():
    scores = torch.rand(13, 24, device=DEV).requires_grad_(True)
    bias = make_bias(24, False)
    _, w = router_select_triton(scores, bias, 4)
    d_w = torch.randn(13, 4, device=DEV)
    (w * d_w).sum().backward()
    s_f64 = scores.detach().double().cpu().requires_grad_(True)
    _, w64 = twin_select(s_f64, bias.cpu(), 4, 1.0)
    (w64 * d_w.double().cpu()).sum().backward()
    assert_close("d scores", s_f64.grad, scores.grad)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n,e,k", [(37, 24, 1), (37, 24, 2), (37, 24, 4), (9, 7, 4), (20, 33, 3)])
@pytest.mark.parametrize("n_bins", [1, 16, 512])
def test_qb_histogram_equals_torch(n, e, k, tied, n_bins):
    scores = torch.sigmoid(make_logits(n, e, tied))
    bias = make_bias(e, tied)
    lo, hi = qb_default_range(bias.cpu())
    counts = qb_histogram_triton(scores, bias, k, n_bins, lo, hi)
    ref = qb_histogram_counts(scores, bias, k, n_bins, lo, hi)
    assert counts.dtype == torch.int64 and counts.shape == (e, n_bins)
    assert torch.equal(counts, ref)
    assert (counts.sum(1) == n).all()


def test_qb_histogram_clamps_into_end_bins():
    """A narrow range: margins below lo / at or above hi must land in bins 0 / nb-1, as in the torch twin."""
    scores, bias = torch.rand(40, 24, device=DEV), make_bias(24, False)
    counts = qb_histogram_triton(scores, bias, 2, 8, -0.05, 0.05)
    ref = qb_histogram_counts(scores, bias, 2, 8, -0.05, 0.05)
    assert torch.equal(counts, ref)
    assert counts[:, 0].sum() > 0 and counts[:, -1].sum() > 0


def test_bad_input_raises():
    s, b = torch.rand(4, 8, device=DEV), torch.zeros(8, device=DEV)
    with pytest.raises(ValueError, match="fp32"):
        router_topk_triton(s.double(), b, 2)
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        router_topk_triton(s, b, 9)
    with pytest.raises(ValueError, match="bias"):
        router_select_triton(s, torch.zeros(7, device=DEV), 2)
    with pytest.raises(ValueError, match=r"\[1, 7\]"):
        qb_histogram_triton(s, b, 8, 16, -1.0, 1.0)
    with pytest.raises(ValueError, match="hi > lo"):
        qb_histogram_triton(s, b, 2, 16, 1.0, 1.0)
