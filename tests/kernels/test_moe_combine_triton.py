"""The fused MoE combine (k3kernels/moe/triton_combine.py) against a float64 reference written from the formula
out[n] = sum_k w[n, k] y[row of (n, k)], forward and backward, and its dispatch from k3.kernels.moe.moe_unpermute.
On a CPU the kernels run under Triton's interpreter (tests/kernels/conftest.py)."""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

from k3.kernels import moe
from k3.kernels.moe import triton_combine
from k3.kernels.testing import LOW_PRECISION as LOW
from k3.kernels.testing import TEST_DEVICE as DEV
from k3.kernels.testing import assert_close

pytestmark = pytest.mark.usefixtures("triton_cpu")


def routed(N=11, K=3, E=5, O=24, dtype=torch.float32, seed=0):
    """Rows y [N K, O] in expert order (moe_permute's layout), its order, routing weights [N, K] (fp32)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    _, order, _ = moe.moe_permute(torch.zeros(N, 1), idx, E)
    y = torch.randn(N * K, O, generator=g).to(DEV, dtype).requires_grad_()
    w = torch.rand(N, K, generator=g).to(DEV).requires_grad_()
    return y, order.to(DEV), w


def reference(y, order, w):
    """The formula in float64: row order[r] of the token-major layout is row r of y."""
    N, K = w.shape
    y_tok = torch.empty_like(y)
    y_tok[order] = y  # y_tok[n K + k] = token n's k-th output
    return (y_tok.view(N, K, -1) * w[..., None]).sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
@pytest.mark.parametrize("shape", [(11, 3, 5, 24), (4, 1, 2, 130)], ids=str)
def test_combine_matches_float64_formula(shape, dtype, kernel_env):
    kernel_env(K3_KERNELS="triton")
    N, K, E, O = shape
    y, order, w = routed(N, K, E, O, dtype)
    out = moe.moe_unpermute(y, order, w)
    assert out.dtype == dtype and out.shape == (N, O)
    g = torch.randn(N, O).to(DEV, dtype)
    dy, dw = torch.autograd.grad(out, (y, w), g)
    assert (dy.dtype, dw.dtype) == (dtype, torch.float32)
    ref_in = [y.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()]
    ref = reference(ref_in[0], order.cpu(), ref_in[1])
    ratio = 1e-6 if dtype == torch.float32 else 1e-2
    for name, a, b in zip(("out", "dy", "dw"), (ref, *torch.autograd.grad(ref, ref_in, g.double().cpu())),
                          (out, dy, dw)):
        assert_close(name, a, b, ratio)


def test_dispatch_kernel_in_training_twin_otherwise(monkeypatch, kernel_env):
    """Under autograd on the triton backend the fused combine runs; under no_grad, for float64 and on the torch
    backend the twin does (equal to it within fp32 rounding); a wrong row count is refused."""
    calls = []
    real = triton_combine._Combine.apply
    monkeypatch.setattr(triton_combine._Combine, "apply", lambda *a: calls.append(1) or real(*a))
    y, order, w = routed()
    kernel_env(K3_KERNELS="triton")
    out = moe.moe_unpermute(y, order, w)
    assert calls == [1]
    with torch.no_grad():
        twin = moe.moe_unpermute(y, order, w)
    assert calls == [1]
    torch.testing.assert_close(out, twin, rtol=1e-6, atol=1e-6)
    moe.moe_unpermute(y.detach().double(), order, w.detach().double())
    kernel_env(K3_KERNELS="torch")
    moe.moe_unpermute(y, order, w)
    assert calls == [1]
    kernel_env(K3_KERNELS="triton")
    with pytest.raises(ValueError, match="rows"):
        moe.moe_unpermute(y[:-1], order, w)
