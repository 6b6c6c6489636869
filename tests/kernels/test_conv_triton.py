"""Triton causal depthwise short conv + SiLU (k3kernels/conv/triton.py) vs the PyTorch twin evaluated in float64.

On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set while importing the module), so
sizes are tiny and the launch blocks are shrunk (`small_blocks`) so that T and C cross several row and channel
blocks at odd sizes. Outputs and dweight partials come from torch.empty, which conftest NaN-poisons: an element a
kernel fails to write fails the comparison. Metric: kda.md 6.1 (`k3.kernels.testing.assert_close`), ratio 1e-5 for
fp32 values and gradients, 1e-2 for bf16 inputs (the interpreter truncates fp32 -> bf16 where a GPU rounds).
"""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

CUDA = torch.cuda.is_available()

# triton and the kernel modules were imported under the interpreter by tests/kernels/conftest.py
from k3.kernels import conv
from k3.kernels.conv import triton as conv_triton
from k3.kernels.conv.naive import causal_conv1d_multi as multi_torch
from k3.kernels.testing import assert_close

DEV = "cuda" if CUDA else "cpu"

pytestmark = pytest.mark.usefixtures("triton_cpu")  # tests/kernels/conftest.py


@pytest.fixture
def small_blocks(monkeypatch):
    """Launch blocks of 8 rows x 4 channels on the interpreter, so tiny tensors cross block edges both ways (each
    interpreted backward program costs ~0.4 s at W = 4: the cases keep few of them); the real blocks on a GPU."""
    if not CUDA:
        for kind in ("fwd", "bwd"):
            monkeypatch.setitem(conv_triton.LAUNCH, kind, {"BT": 8, "BC": 4, "num_warps": 1})


def inputs(n, B, T, C, W, dtype=torch.float32, w_dtype=torch.float32):
    xs = [torch.randn(B, T, C).to(DEV, dtype).requires_grad_() for _ in range(n)]
    ws = [(torch.randn(C, W) / W**0.5).to(DEV, w_dtype).requires_grad_() for _ in range(n)]
    return xs, ws


def reference(xs, ws, dys, activation, cu_seqlens):
    """y and the gradients of every x and weight through the twin in float64 autograd."""
    x64 = [x.detach().double().cpu().requires_grad_() for x in xs]
    w64 = [w.detach().double().cpu().requires_grad_() for w in ws]
    cu = None if cu_seqlens is None else cu_seqlens.cpu()
    ys = multi_torch(x64, w64, activation=activation, cu_seqlens=cu)
    grads = torch.autograd.grad(ys, x64 + w64, [dy.double().cpu() for dy in dys])
    return ys, grads


def check(xs, ws, activation="silu", cu_seqlens=None, ratio=1e-5):
    ys = conv_triton.causal_conv1d_multi_triton(xs, ws, activation=activation, cu_seqlens=cu_seqlens)
    assert [y.dtype for y in ys] == [x.dtype for x in xs] and [y.shape for y in ys] == [x.shape for x in xs]
    dys = [torch.randn_like(y) for y in ys]
    grads = torch.autograd.grad(ys, xs + ws, dys)
    assert [g.dtype for g in grads] == [t.dtype for t in xs + ws]
    ys_ref, grads_ref = reference(xs, ws, dys, activation, cu_seqlens)
    for i, (ref, out) in enumerate(zip(ys_ref, ys)):
        assert_close(f"y{i}", ref, out, ratio)
    names = [f"dx{i}" for i in range(len(xs))] + [f"dweight{i}" for i in range(len(ws))]
    for name, ref, out in zip(names, grads_ref, grads):
        assert_close(name, ref, out, ratio)


@pytest.mark.parametrize("n,B,T,C,W,activation", [
    (3, 2, 11, 6, 4, "silu"),  # q, k, v in one launch; T and C past one block, not multiples of it
    (1, 2, 11, 5, 3, None),  # batch rows, another width, no activation
    (2, 2, 5, 3, 1, "silu"),  # width 1: no taps into the past
], ids=lambda v: str(v))
def test_conv_matches_float64_twin(n, B, T, C, W, activation, small_blocks):
    check(*inputs(n, B, T, C, W), activation=activation)


@pytest.mark.parametrize("W", [4, 2])
def test_packed_sequences_never_reach_across_a_boundary(W, small_blocks):
    """cu_seqlens with an empty sequence, sequences shorter than W-1 and boundaries inside a row block."""
    cu = torch.tensor([0, 2, 2, 9, 10, 21], device=DEV)
    check(*inputs(3, 1, 21, 5, W), cu_seqlens=cu)


def test_default_blocks_over_several_blocks():
    """The shipped launch blocks (LAUNCH: 64 / 32 rows, 128 / 64 channels) with T and C past one block each."""
    check(*inputs(1, 1, 70, 130, 4))


def test_bf16_inputs_with_fp32_weights(small_blocks):
    """What a layer under bf16 autocast hands over: bf16 projections, fp32 conv weights; y and dx in bf16, dweight
    in fp32."""
    check(*inputs(2, 1, 11, 4, 4, dtype=torch.bfloat16), ratio=1e-2)


def test_public_ops_dispatch(monkeypatch, kernel_env, small_blocks):
    """On K3_KERNELS=triton causal_conv1d and causal_conv1d_multi run the kernel for tail-free fp32 / bf16 calls;
    a carried tail and float64 run the twin; the torch backend is the twin."""
    calls = []
    real = conv_triton._CausalConv1d.apply
    monkeypatch.setattr(conv_triton._CausalConv1d, "apply", lambda *a: calls.append(len(a)) or real(*a))
    kernel_env(K3_KERNELS="triton")
    xs, ws = inputs(3, 1, 9, 5, 4)
    ys = conv.causal_conv1d_multi(xs, ws)
    y, tail = conv.causal_conv1d(xs[0], ws[0])
    assert calls == [2 + 6, 2 + 2] and tail is None
    y_ref = multi_torch([x.detach().double() for x in xs], [w.detach().double() for w in ws])
    assert_close("y", y_ref[0], ys[0], 1e-5)
    assert_close("y single", y_ref[0], y, 1e-5)
    y_t, tail = conv.causal_conv1d(xs[0], ws[0], output_final_tail=True)  # inference: the twin keeps the tail
    assert calls == [8, 4] and tail.shape == (1, 3, 5)
    assert_close("y with tail", y_ref[0], y_t, 1e-5)
    x64, w64 = xs[0].detach().double(), ws[0].detach().double()
    assert conv.causal_conv1d_multi([x64], [w64])[0].dtype == torch.float64 and calls == [8, 4]
    kernel_env(K3_KERNELS="torch")
    conv.causal_conv1d_multi(xs, ws)
    assert calls == [8, 4]


def test_bad_inputs_raise():
    xs, ws = inputs(2, 1, 5, 4, 4)
    with pytest.raises(ValueError, match="one shape and dtype"):
        conv_triton.causal_conv1d_multi_triton([xs[0], xs[1][:, :3]], ws)
    with pytest.raises(ValueError, match="1 to 3 inputs"):
        conv_triton.causal_conv1d_multi_triton(xs * 2, ws * 2)
    with pytest.raises(ValueError, match="cu_seqlens requires B == 1"):
        conv_triton.causal_conv1d_multi_triton(*inputs(1, 2, 5, 4, 4), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="weight must be"):
        conv_triton.causal_conv1d_multi_triton([xs[0]], [torch.randn(5, 4, device=DEV)])
