"""A k3-debug KDA layer's training step on the "triton" backend (the fused short conv over q, k, v and the fused
gated RMSNorm, with the chunk kernels; Triton's interpreter on a CPU) equals the same layer on the "torch" backend:
output and every gradient (x and each parameter), for batch rows and for packed sequences (cu_seqlens), fp32,
kda.md 6.1's metric (ratio 1e-4)."""

import dataclasses
import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

CUDA = torch.cuda.is_available()

# triton and the kernel modules were imported under the interpreter by tests/kernels/conftest.py
from k3.cli.config import load_model_config
from k3.kernels.conv import triton as conv_triton
from k3.kernels.norm import triton as norm_triton
from k3.kernels.testing import assert_close
from k3.model.kda import KimiDeltaAttention

DEV = "cuda" if CUDA else "cpu"

pytestmark = pytest.mark.usefixtures("triton_cpu")  # tests/kernels/conftest.py


def step(layer, x, cu_seqlens):
    """The layer's output and the gradients of x and every parameter for a fixed random output gradient."""
    x = x.detach().requires_grad_()
    y = layer(x, cu_seqlens=cu_seqlens)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    names, params = zip(*layer.named_parameters())
    grads = torch.autograd.grad(y, (x, *params), dy)
    return y, dict(zip(("x", *names), grads))


@pytest.mark.parametrize("B,T,cu", [(2, 37, None), (1, 45, [0, 13, 13, 45])], ids=["batch", "packed"])
def test_kda_layer_triton_backend_equals_torch_backend(B, T, cu, monkeypatch, kernel_env):
    calls = []
    for fn in (conv_triton._CausalConv1d, norm_triton._GatedRMSNorm):
        real = fn.apply
        monkeypatch.setattr(fn, "apply", lambda *a, _real=real, _name=fn.__name__: calls.append(_name) or _real(*a))
    cfg = dataclasses.replace(load_model_config("k3-debug"), kda_chunk_size=16)
    torch.manual_seed(0)
    layer = KimiDeltaAttention(cfg, layer_idx=0).to(DEV)
    with torch.no_grad():  # a norm gain and conv weights away from their init, so each gradient is non-trivial
        layer.o_norm.weight.uniform_(0.5, 1.5)
        for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
            conv.weight.uniform_(-0.5, 0.5)
    x = torch.randn(B, T, cfg.d_model, device=DEV)
    cu_seqlens = None if cu is None else torch.tensor(cu, device=DEV)
    kernel_env(K3_KERNELS="torch")
    y_ref, g_ref = step(layer, x, cu_seqlens)
    assert calls == []
    kernel_env(K3_KERNELS="triton", K3_KDA_BWD="triton")
    y, g = step(layer, x, cu_seqlens)
    assert calls == ["_CausalConv1d", "_GatedRMSNorm"]  # one conv launch for q, k and v
    # fp32 kernels against fp32 PyTorch: ~2e-6 measured on the interpreter for y and every gradient
    assert_close("y", y_ref, y, 1e-4)
    for name in g_ref:
        assert_close(f"d{name}", g_ref[name], g[name], 1e-4)


@pytest.mark.skipif(not CUDA, reason="torch.compile traces the Triton launches only as GPU (JIT) kernels")
def test_conv_and_norm_under_torch_compile_match_eager(monkeypatch):
    """The short conv over q, k, v and the gated RMSNorm inside torch.compile (as `k3 pretrain` with train.compile):
    dynamo traces both autograd Functions and their launches; outputs and gradients equal the eager calls' (bf16)."""
    from k3.kernels.conv import causal_conv1d_multi
    from k3.kernels.norm import gated_rms_norm

    # inductor fails on the conftest's NaN-poisoned allocations (test_decode_compile says how): the real torch.empty
    monkeypatch.setattr(torch, "empty", getattr(torch.empty, "real", torch.empty))
    monkeypatch.setenv("K3_KERNELS", "triton")
    torch._dynamo.reset()
    B, T, H, K = 2, 77, 2, 64
    xs = [torch.randn(B, T, H * K, device=DEV, dtype=torch.bfloat16) for _ in range(3)]
    ws = [torch.randn(H * K, 4, device=DEV) / 2 for _ in range(3)]
    gate, nw = torch.randn(B, T, H, K, device=DEV, dtype=torch.bfloat16), torch.rand(K, device=DEV) + 0.5

    def step(x0, x1, x2, w0, w1, w2, gate, nw):
        q, k, v = causal_conv1d_multi([x0, x1, x2], [w0, w1, w2])
        y = gated_rms_norm((q * k + v).unflatten(-1, (H, K)), gate, nw, 1e-5)
        return (y.float() ** 2).sum()

    grads = []
    for fn in (step, torch.compile(step)):
        leaves = [t.detach().clone().requires_grad_() for t in (*xs, *ws, gate, nw)]
        loss = fn(*leaves)
        grads.append([loss.detach(), *torch.autograd.grad(loss, leaves)])
    # inductor fuses q * k + v and the squares without eager's bf16 rounding of each op: bf16 gradients then
    # differ by a bf16 rounding (4e-3 measured on an H200), the loss by much less
    for i, (a, b) in enumerate(zip(*grads, strict=True)):
        assert_close(f"output {i} (compiled vs eager)", a.double(), b.double(), 1e-3 if i == 0 else 1e-2)
