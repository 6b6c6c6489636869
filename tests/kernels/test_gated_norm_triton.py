"""Fused gated and plain RMSNorms (k3kernels/norm/triton.py) vs the PyTorch twins evaluated in float64, and the twins
against independent formulas; the model's GatedRMSNorm and RMSNorm call the ops.

On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set while importing the module), so
sizes are tiny. Outputs and dweight partials come from torch.empty, which conftest NaN-poisons. Metric: kda.md 6.1
(`k3.kernels.testing.assert_close`), ratio 1e-5 for fp32, 1e-2 for bf16 inputs.
"""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

CUDA = torch.cuda.is_available()

# triton and the kernel modules were imported under the interpreter by tests/kernels/conftest.py
from k3.kernels import norm
from k3.kernels.norm import triton as norm_triton
from k3.kernels.norm.naive import gated_rms_norm, rms_norm
from k3.kernels.testing import assert_close
from k3.model.kda import GatedRMSNorm
from k3.model.layers import RMSNorm

DEV = "cuda" if CUDA else "cpu"

pytestmark = pytest.mark.usefixtures("triton_cpu")  # tests/kernels/conftest.py


def formula(o, gate, weight, eps):
    """o / sqrt(mean(o^2) + eps) * weight * sigmoid(gate), written out in float64."""
    o, gate, weight = o.double(), gate.double(), weight.double()
    return o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight / (1 + torch.exp(-gate))


def inputs(shape, dtype=torch.float32, gate_std=2.0):
    o = torch.randn(shape).to(DEV, dtype).requires_grad_()
    gate = (torch.randn(shape) * gate_std).to(DEV, dtype).requires_grad_()
    weight = (torch.rand(shape[-1]) + 0.5).to(DEV).requires_grad_()  # fp32, as the layer's parameter
    return o, gate, weight


def check(o, gate, weight, eps=1e-5, ratio=1e-5):
    y = norm_triton.gated_rms_norm_triton(o, gate, weight, eps)
    assert y.dtype == o.dtype and y.shape == o.shape
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (o, gate, weight), dy)
    assert [g.dtype for g in grads] == [o.dtype, gate.dtype, weight.dtype]
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (o, gate, weight)]
    y_ref = gated_rms_norm(*ref_in, eps)
    grads_ref = torch.autograd.grad(y_ref, ref_in, dy.double().cpu())
    assert_close("y", y_ref, y, ratio)
    for name, ref, out in zip(("do", "dgate", "dweight"), grads_ref, grads):
        assert_close(name, ref, out, ratio)


@pytest.mark.parametrize("shape", [(2, 5, 3, 32), (70, 24), (1, 3, 100)], ids=str)
def test_gated_norm_matches_float64_twin(shape):
    """Rows past one program (70 rows of 24: BR = 64) and a V that is not a power of two (24, 100)."""
    check(*inputs(shape))


def test_saturated_gates_and_large_eps():
    """Gates at +-30 (sigmoid 0 or 1 in fp32, dgate ~ 0) and an eps that matters against small rows."""
    o, gate, weight = inputs((9, 16), gate_std=30.0)
    with torch.no_grad():
        o[:3] *= 1e-3
    check(o, gate, weight, eps=1e-4)


def test_bf16_inputs_with_fp32_weight():
    """A layer under bf16 autocast: o and gate bf16, the norm weight fp32; y, do, dgate bf16, dweight fp32."""
    check(*inputs((4, 6, 2, 32), dtype=torch.bfloat16), ratio=1e-2)


def test_twin_is_the_formula():
    o, gate, weight = (t.detach().double() for t in inputs((3, 4, 2, 8)))
    torch.testing.assert_close(gated_rms_norm(o, gate, weight, 1e-5), formula(o, gate, weight, 1e-5), rtol=1e-13,
                               atol=1e-13)


def test_model_norm_dispatches(monkeypatch, kernel_env):
    """The model's GatedRMSNorm runs the fused kernel on K3_KERNELS=triton (equal to the float64 formula in values
    and gradients), the twin on the torch backend and for float64 (equal to the formula to float64 rounding)."""
    calls = []
    real = norm_triton._GatedRMSNorm.apply
    monkeypatch.setattr(norm_triton._GatedRMSNorm, "apply", lambda *a: calls.append(1) or real(*a))
    layer = GatedRMSNorm(16, eps=1e-5).to(DEV)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
    o, gate, _ = inputs((2, 3, 2, 16))
    kernel_env(K3_KERNELS="triton")
    y = layer(o, gate)
    assert calls == [1]
    do, dg, dw = torch.autograd.grad(y, (o, gate, layer.weight), torch.ones_like(y))
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (o, gate, layer.weight)]
    y_ref = formula(*ref_in, 1e-5)
    for name, ref, out in zip(("y", "do", "dgate", "dweight"),
                              (y_ref, *torch.autograd.grad(y_ref, ref_in, torch.ones_like(y_ref))), (y, do, dg, dw)):
        assert_close(name, ref, out, 1e-5)
    y64 = layer.double()(o.detach().double(), gate.detach().double())
    assert calls == [1] and y64.dtype == torch.float64
    torch.testing.assert_close(y64, formula(o, gate, layer.weight, 1e-5).to(DEV), rtol=1e-13, atol=1e-13)
    kernel_env(K3_KERNELS="torch")
    layer.float()(o, gate)
    assert calls == [1]


def test_bad_shapes_raise(kernel_env):
    kernel_env(K3_KERNELS="triton")
    o, gate, weight = inputs((3, 8))
    with pytest.raises(ValueError, match="must share a shape"):
        norm.gated_rms_norm(o, gate[:, :4], weight)
    with pytest.raises(ValueError, match="must be \\[V=8\\]"):
        norm.gated_rms_norm(o, gate, weight[:4])


def plain_formula(x, weight, eps):
    """x / sqrt(mean(x^2) + eps) * weight, written out in float64."""
    x, weight = x.double(), weight.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def check_plain(x, weight, eps=1e-5, ratio=1e-5):
    y = norm_triton.rms_norm_triton(x, weight, eps)
    assert y.dtype == x.dtype and y.shape == x.shape
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, weight), dy)
    assert (dx.dtype, dw.dtype) == (x.dtype, weight.dtype)
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (x, weight)]
    y_ref = plain_formula(*ref_in, eps)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, ref_in, dy.double().cpu())
    for name, ref, out in (("y", y_ref, y), ("dx", dx_ref, dx), ("dweight", dw_ref, dw)):
        assert_close(name, ref, out, ratio)


LOW = torch.bfloat16 if CUDA else torch.float16  # the interpreter has no bf16


@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
@pytest.mark.parametrize("shape", [(2, 5, 96), (70, 24), (1, 3, 100)], ids=str)
def test_rms_norm_matches_float64_formula(shape, dtype):
    """Rows past one block (70 rows of 24: BR = 64), widths that are not powers of two, an fp32 weight beside
    fp16 / bf16 activations (the model under autocast)."""
    x, _, weight = inputs(shape, dtype=dtype)
    check_plain(x, weight, ratio=1e-5 if dtype == torch.float32 else 1e-2)


def test_backward_walks_several_row_blocks(monkeypatch):
    """A backward program over TILES > 1 row blocks, the last one partial (37 rows in blocks of 4, 2 programs of
    8 blocks): dweight sums every block once, dx and dgate cover every row."""
    monkeypatch.setattr(norm_triton, "BWD_PROGRAMS", 2)
    monkeypatch.setattr(norm_triton, "ROW_ELEMENTS", 64)
    assert norm_triton._tiles(37, norm_triton._blocks(16)[1]) == 8
    x, gate, weight = inputs((37, 16))
    check_plain(x, weight)
    check(x, gate, weight)


def test_plain_twin_is_the_formula():
    x, _, weight = (t.detach().double() for t in inputs((3, 4, 24)))
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), plain_formula(x, weight, 1e-5), rtol=1e-13, atol=1e-13)


def test_model_rmsnorm_dispatches(monkeypatch, kernel_env):
    """The model's RMSNorm runs the fused kernel when autograd records it on K3_KERNELS=triton; under no_grad
    (inference, the compiled decode), for float64 and on the torch backend it runs the twin."""
    calls = []
    real = norm_triton._RMSNorm.apply
    monkeypatch.setattr(norm_triton._RMSNorm, "apply", lambda *a: calls.append(1) or real(*a))
    layer = RMSNorm(24, eps=1e-5).to(DEV)
    x, _, _ = inputs((2, 3, 24))
    kernel_env(K3_KERNELS="triton")
    y = layer(x)
    assert calls == [1]
    dx, dw = torch.autograd.grad(y, (x, layer.weight), torch.ones_like(y))
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (x, layer.weight)]
    y_ref = plain_formula(*ref_in, 1e-5)
    for name, ref, out in zip(("y", "dx", "dweight"),
                              (y_ref, *torch.autograd.grad(y_ref, ref_in, torch.ones_like(y_ref))), (y, dx, dw)):
        assert_close(name, ref, out, 1e-5)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), rms_norm(x, layer.weight, 1e-5), rtol=0, atol=0)
    y64 = layer.double()(x.detach().double())
    assert calls == [1] and y64.dtype == torch.float64
    kernel_env(K3_KERNELS="torch")
    layer.float()(x)
    assert calls == [1]
    kernel_env(K3_KERNELS="triton")
    with pytest.raises(ValueError, match="must be \\[V=24\\]"):
        norm.rms_norm(x, layer.weight[:4])
