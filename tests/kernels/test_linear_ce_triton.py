"""The chunked head + cross-entropy's [C, V] step as a Triton kernel (k3kernels/loss/triton.py) against its PyTorch
twin and, through linear_cross_entropy on the triton backend, against an independent float64 reference over the
whole logits. On a CPU the kernel runs under Triton's interpreter (tests/kernels/conftest.py), at small sizes; rows
longer than one block (BLOCK_V patched small) exercise the online max and sum."""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

from k3.kernels.loss import chunked, linear_cross_entropy
from k3.kernels.loss import triton as loss_triton
from k3.kernels.testing import LOW_PRECISION as LOW
from k3.kernels.testing import TEST_DEVICE as DEV
from k3.kernels.testing import assert_close

pytestmark = pytest.mark.usefixtures("triton_cpu")


def reference(h, w, t):
    """Mean over counted targets of -log softmax(h W^T)[t], written out in float64."""
    z = h.double() @ w.double().T
    logp = z - z.logsumexp(-1, keepdim=True)
    keep = t != -100
    return -logp[keep.nonzero()[:, 0], t[keep]].sum() / keep.sum()


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "loss-only"])
@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
def test_rows_equal_the_twin(monkeypatch, dtype, grad):
    """V = 300 in blocks of 128 (the last one partial), logits up to +-60 (exp would overflow without the running
    max), a target in the partial block: the targets' log-probabilities and the in-place gradient match the twin."""
    monkeypatch.setattr(loss_triton, "BLOCK_V", 128)
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(7, 300, generator=g) * 20).clamp(-60, 60)
    z[0, 5] = 60.0
    t = torch.randint(0, 300, (7, 1), generator=g)
    t[1] = 299
    z_k, z_t = z.to(DEV, dtype).clone(), z.to(DEV, dtype).clone()  # both are written in place
    lpt_k = loss_triton.softmax_rows_triton(z_k, t.to(DEV), None, grad)
    lpt_t = chunked.softmax_rows_torch(z_t, t.to(DEV), torch.empty(z.shape, device=DEV), grad)
    assert lpt_k.dtype == torch.float32 and lpt_k.shape == (7, 1)
    assert_close("lpt", lpt_t.double().cpu(), lpt_k, 1e-6)
    if grad:
        assert_close("softmax - onehot", z_t.double().cpu(), z_k, 1e-6 if dtype == torch.float32 else 1e-3)
        assert torch.allclose(z_k.double().sum(1), torch.zeros(7, dtype=torch.float64, device=DEV), atol=2e-2)
    else:
        assert torch.equal(z_k, z.to(DEV, dtype))  # the loss alone leaves z as it was


def test_linear_cross_entropy_on_the_kernel_matches_float64(monkeypatch, kernel_env):
    """The whole op on K3_KERNELS=triton (every chunk through the kernel, chunks that do not divide N, ignored
    targets): loss, dh and dW against the float64 reference; the kernel ran once per chunk."""
    kernel_env(K3_KERNELS="triton")
    monkeypatch.setattr(loss_triton, "BLOCK_V", 64)
    calls = []
    real = loss_triton._ce_rows_kernel
    monkeypatch.setattr(loss_triton, "_ce_rows_kernel",
                        type("Spy", (), {"__getitem__": lambda self, grid: calls.append(grid) or real[grid]})())
    g = torch.Generator().manual_seed(1)
    h = torch.randn(37, 24, generator=g).to(DEV).requires_grad_()
    w = (torch.randn(150, 24, generator=g) * 0.5).to(DEV).requires_grad_()
    t = torch.randint(0, 150, (37,), generator=g).to(DEV)
    t[::4] = -100
    loss = linear_cross_entropy(h, w, t, chunk_tokens=16)
    dh, dw = torch.autograd.grad(loss, (h, w))
    assert len(calls) == 3
    ref_in = [h.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()]
    ref = reference(*ref_in, t.cpu())
    for name, a, b in zip(("loss", "dh", "dW"), (ref, *torch.autograd.grad(ref, ref_in)), (loss, dh, dw)):
        assert_close(name, a, b, 1e-5)
    assert (dh[t == -100] == 0).all()
