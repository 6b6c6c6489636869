"""The fused LM head + cross-entropy (k3.kernels.loss.linear_cross_entropy) against an independent float64
reference over the whole logits: loss and gradients of h and W, ignored targets, chunks that do not divide N, one
token, chunks and batches with nothing counted, autocast, and no [N, V] tensor ever made."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from k3.kernels.loss import default_chunk_tokens, linear_cross_entropy, linear_cross_entropy_torch
from k3.kernels.testing import assert_close


def reference(h, w, t):
    """Mean over counted targets of -log softmax(h W^T)[t], written out in float64."""
    z = h.double() @ w.double().T
    logp = z - z.logsumexp(-1, keepdim=True)
    keep = t != -100
    return -logp[keep.nonzero()[:, 0], t[keep]].sum() / keep.sum()


def inputs(N, D, V, dtype, ignore_every=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    return h, w, t


def loss_and_grads(fn, h, w, t, scale=1.0):
    loss = fn(h, w, t)
    dh, dw = torch.autograd.grad(loss * scale, (h, w))
    return loss.detach(), dh, dw


# (N, chunk): chunks that divide N, that do not, one chunk larger than N, one token
SHAPES = [(37, 8), (36, 12), (37, 100), (1, 16), (64, 7), (5, 1)]


@pytest.mark.parametrize("N,chunk", SHAPES, ids=[f"N{n}-C{c}" for n, c in SHAPES])
def test_float64_equals_the_whole_logits(N, chunk):
    h, w, t = inputs(N, 16, 50, torch.float64, ignore_every=3 if N > 1 else 0)
    got = loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_tokens=chunk), h, w, t, scale=1.7)
    ref = loss_and_grads(reference, h, w, t, scale=1.7)
    assert got[0].dtype == torch.float64
    for name, a, b in zip(("loss", "dh", "dW"), got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)
    ignored = t == -100
    assert (got[1][ignored] == 0).all()  # an ignored token gets no gradient


@pytest.mark.parametrize("N,chunk", SHAPES, ids=[f"N{n}-C{c}" for n, c in SHAPES])
def test_fp32_equals_the_whole_logits(N, chunk):
    h, w, t = inputs(N, 24, 70, torch.float32, ignore_every=4 if N > 1 else 0, seed=1)
    got = loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_tokens=chunk), h, w, t)
    ref64 = loss_and_grads(reference, h, w, t)
    twin = loss_and_grads(linear_cross_entropy_torch, h, w, t)  # the path the train loop had: fp32 logits whole
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32
    for name, a, b, c in zip(("loss", "dh", "dW"), got, ref64, twin):
        assert_close(name, b, a, 1e-5)
        assert_close(name, c, a, 1e-5)


def test_nothing_counted_in_a_chunk_or_in_the_batch():
    h, w, t = inputs(20, 8, 30, torch.float64, ignore_every=0)
    t[:8] = -100  # the first chunk of 8 counts nothing
    got = loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_tokens=8), h, w, t)
    for a, b in zip(got, loss_and_grads(reference, h, w, t)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    t[:] = -100  # the whole batch: NaN loss and zero gradients, as F.cross_entropy's mean gives
    got = loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_tokens=8), h, w, t)
    ref = loss_and_grads(lambda h, w, t: F.cross_entropy(h @ w.T, t, ignore_index=-100), h, w, t)
    assert got[0].isnan() and ref[0].isnan()
    assert (got[1] == 0).all() and (got[2] == 0).all() and (ref[1] == 0).all() and (ref[2] == 0).all()


def test_only_the_needed_gradients_and_none_under_no_grad():
    h, w, t = inputs(30, 8, 40, torch.float64)
    ref = loss_and_grads(reference, h, w, t)
    (dh,) = torch.autograd.grad(linear_cross_entropy(h, w.detach(), t, 7), (h,))
    (dw,) = torch.autograd.grad(linear_cross_entropy(h.detach(), w, t, 7), (w,))
    torch.testing.assert_close(dh, ref[1], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dw, ref[2], rtol=1e-12, atol=1e-14)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t, 7)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, ref[0], rtol=1e-12, atol=0)


def test_bf16_autocast_runs_the_gemms_in_bf16_and_returns_fp32_gradients():
    h, w, t = inputs(40, 32, 64, torch.float32)
    ref64 = loss_and_grads(reference, h, w, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_tokens=16), h, w, t)
        twin = loss_and_grads(linear_cross_entropy_torch, h, w, t)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    for name, a, b, c in zip(("loss", "dh", "dW"), got, ref64, twin):
        assert_close(name, c, a, 1e-2)  # both round h, W and the softmax gradient to bf16
        assert_close(name, b, a, 2e-2)
    # the logits are bf16: the loss differs from fp32's by bf16 rounding, not by nothing
    assert (got[0] - ref64[0]).abs() > 1e-6


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [x.numel() for x in tree_leaves(out) if isinstance(x, torch.Tensor)])
        return out


def test_no_tensor_as_large_as_the_logits():
    N, D, V, chunk = 64, 8, 100, 16
    h, w, t = inputs(N, D, V, torch.float32)
    with _LargestTensor() as big:
        torch.autograd.grad(linear_cross_entropy(h, w, t, chunk), (h, w))
    assert big.numel == chunk * V  # the chunk's logits; the whole would be N * V
    with _LargestTensor() as big:
        torch.autograd.grad(linear_cross_entropy_torch(h, w, t), (h, w))
    assert big.numel == N * V


def test_default_chunk_and_input_checks():
    assert default_chunk_tokens(4096, "cpu") == 256
    assert default_chunk_tokens(32768, "cuda") == 2048
    assert default_chunk_tokens(32768, "cpu") == default_chunk_tokens(10**7, "cpu") == 64
    h, w, t = inputs(6, 4, 10, torch.float32)
    with pytest.raises(ValueError, match=r"h \[N, D\] and weight \[V, D\]"):
        linear_cross_entropy(h[None], w, t)
    with pytest.raises(ValueError, match="targets must be integer class indices"):
        linear_cross_entropy(h, w, t.float())
    with pytest.raises(ValueError, match="chunk_tokens must be a positive"):
        linear_cross_entropy(h, w, t, 0)


@pytest.mark.cuda
def test_cuda_bf16_autocast_against_float64():
    h, w, t = inputs(300, 64, 1000, torch.float32)
    h, w, t = (h.detach().cuda().requires_grad_(), w.detach().cuda().requires_grad_(), t.cuda())
    ref64 = loss_and_grads(reference, h, w, t)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_tokens=128), h, w, t)
        twin = loss_and_grads(linear_cross_entropy_torch, h, w, t)
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.float32
    for name, a, b, c in zip(("loss", "dh", "dW"), got, ref64, twin):
        assert_close(name, c, a, 1e-2)
        assert_close(name, b, a, 2e-2)
