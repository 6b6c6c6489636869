"""Fused Triton C2-GLU (k3kernels/glu/triton.py) vs the naive twin `c2_glu` evaluated in float64 (architecture.md 8).

On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set while importing the module), so shapes
are small. Outputs are allocated with torch.empty, which conftest NaN-poisons: an element the kernel fails to write
fails the comparison. Metric (kda.md 6.1 style): pass if max |ref - out| <= 1e-6, else no NaN and
rms(ref - out) / (rms(ref) + 1e-8) < ratio; ratio 1e-5 for fp32 values and gradients (fp32 math, a few ulp per
element), 1e-2 for bf16 (GPU only; interpreter tests run fp32).
"""

import importlib
import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

CUDA = torch.cuda.is_available()


# triton and the kernel modules were imported under the interpreter by tests/kernels/conftest.py

from k3.kernels.glu.naive import c2_glu
from k3.kernels.glu.triton import c2_glu_split_triton, c2_glu_triton
from k3.kernels.testing import assert_close

DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]


pytestmark = pytest.mark.usefixtures("triton_cpu")  # tests/kernels/conftest.py




def ratio_for(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


def reference(gu, dh, beta1, beta2):
    """h and d gate_up through the naive twin, float64 autograd."""
    x = gu.detach().double().cpu().requires_grad_(True)
    m = x.shape[-1] // 2
    h = c2_glu(x[..., :m], x[..., m:], beta1, beta2)
    h.backward(dh.double().cpu())
    return h.detach(), x.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,std", [((37, 200), 1.0), ((2, 5, 64), 3.0), ((1, 258), 10.0)])
def test_c2_glu_matches_float64_twin(shape, std, dtype):
    gu = (torch.randn(shape) * std).to(DEV, dtype).requires_grad_(True)
    dh = torch.randn(*shape[:-1], shape[-1] // 2).to(DEV, dtype)
    h = c2_glu_triton(gu, 4.0, 25.0)
    assert h.dtype == dtype and h.shape == dh.shape
    h.backward(dh)
    h_ref, dgu_ref = reference(gu, dh, 4.0, 25.0)
    assert_close("h", h_ref, h, ratio_for(dtype))
    assert_close("d gate_up", dgu_ref, gu.grad, ratio_for(dtype))


def test_split_halves_and_other_betas():
    """Separate gate/up (views of one packed tensor, as GroupedExperts splits them) and non-default betas."""
    gu = (torch.randn(9, 2 * 33) * 4).to(DEV).requires_grad_(True)
    gate, up = gu.split(33, dim=-1)
    dh = torch.randn(9, 33).to(DEV)
    c2_glu_split_triton(gate, up, 2.0, 7.0).backward(dh)
    h_ref, dgu_ref = reference(gu, dh, 2.0, 7.0)
    assert_close("h", h_ref, c2_glu_split_triton(gate, up, 2.0, 7.0), 1e-5)
    assert_close("d gate_up", dgu_ref, gu.grad, 1e-5)


def test_non_contiguous_input():
    """A transposed (column-major) packed input is copied to rows; the gradient still reaches it in its layout."""
    base = (torch.randn(2 * 50, 7) * 2).to(DEV).requires_grad_(True)
    gu = base.t()  # [7, 100], stride (1, 7)
    dh = torch.randn(7, 50).to(DEV)
    c2_glu_triton(gu).backward(dh)
    h_ref, dgu_ref = reference(gu, dh, 4.0, 25.0)
    assert_close("h", h_ref, c2_glu_triton(gu), 1e-5)
    assert_close("d gate_up", dgu_ref.t(), base.grad, 1e-5)


@pytest.mark.parametrize("std", [50.0, 200.0])
def test_large_inputs_stay_bounded(std):
    """architecture.md 8.2: with std 50 / 200 inputs max |h| approaches b1 b2 = 100 and never exceeds it."""
    gu = (torch.randn(64, 256) * std).to(DEV).requires_grad_(True)
    h = c2_glu_triton(gu)
    assert torch.isfinite(h).all()
    assert h.abs().max().item() <= 100.0
    assert h.abs().max().item() > 99.0
    h.sum().backward()
    assert torch.isfinite(gu.grad).all()
    h_ref, dgu_ref = reference(gu, torch.ones_like(h), 4.0, 25.0)
    assert_close("h", h_ref, h, 1e-5)
    assert_close("d gate_up", dgu_ref, gu.grad, 1e-5)


def test_gradient_never_vanishes_at_large_inputs():
    """8.2: in fp32 the gradient is non-zero at g = +-20 and u = +-100 (a hard clamp would give exactly 0)."""
    g = torch.tensor([[20.0, -20.0, 20.0, -20.0]], device=DEV)
    u = torch.tensor([[100.0, -100.0, 1.0, 1.0]], device=DEV)
    gu = torch.cat([g, u], -1).requires_grad_(True)
    c2_glu_triton(gu).sum().backward()
    assert (gu.grad != 0).all(), gu.grad


def test_small_gate_is_silu():
    """8.2: for |g| <= 0.05, b1 tanh(g / b1) sigmoid(g) is within 2e-6 of SiLU(g) (here via u chosen so B(u) = 1)."""
    g = torch.linspace(-0.05, 0.05, 41, device=DEV)[None]
    u = torch.full_like(g, 25.0 * torch.atanh(torch.tensor(1 / 25.0)).item())  # b2 tanh(u / b2) = 1
    h = c2_glu_triton(torch.cat([g, u], -1))
    assert (h - torch.nn.functional.silu(g)).abs().max().item() < 2e-6


def test_bad_input_raises():
    with pytest.raises(ValueError, match="even last dim"):
        c2_glu_triton(torch.randn(3, 5, device=DEV))
    with pytest.raises(ValueError, match="float64"):
        c2_glu_triton(torch.randn(3, 4, device=DEV, dtype=torch.float64))
    with pytest.raises(ValueError, match="same shape"):
        c2_glu_split_triton(torch.randn(3, 4, device=DEV), torch.randn(3, 5, device=DEV))


def test_public_c2_glu_dispatches_to_the_fused_kernel(monkeypatch, kernel_env):
    """k3.kernels.glu.c2_glu on K3_KERNELS=triton runs the fused kernel (gradients from its backward, equal to the
    float64 twin), keeps float64 on the PyTorch twin, and on the torch backend is the twin itself."""
    from k3.kernels import glu
    from k3.kernels.glu import triton as glu_triton

    kernel_env(K3_KERNELS="triton")
    calls = []
    real = glu_triton.c2_glu_split_triton
    monkeypatch.setattr(glu_triton, "c2_glu_split_triton", lambda *a: calls.append(1) or real(*a))
    g = (torch.randn(5, 24) * 8).to(DEV).requires_grad_()
    u = (torch.randn(5, 24) * 40).to(DEV).requires_grad_()
    h = glu.c2_glu(g, u)
    assert calls == [1]
    dg, du = torch.autograd.grad(h.sum(), (g, u))
    g64, u64 = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    h64 = c2_glu(g64, u64)
    dg64, du64 = torch.autograd.grad(h64.sum(), (g64, u64))
    for ref, out in ((h64, h), (dg64, dg), (du64, du)):
        assert ((ref - out.double()).norm() / ref.norm()).item() < 1e-5
    assert glu.c2_glu(g64, u64).dtype == torch.float64 and calls == [1]  # float64 stays on the twin
    kernel_env(K3_KERNELS="torch")
    glu.c2_glu(g, u)
    assert calls == [1]


def test_public_c2_glu_packed_dispatches_to_the_packed_kernel(monkeypatch, kernel_env):
    """k3.kernels.glu.c2_glu_packed on K3_KERNELS=triton runs the packed kernel (one [N, 2m] gradient, equal to the
    float64 formula's), float64 and the torch backend the twin; the model's GatedMLP goes through it; an odd width
    is refused."""
    from k3.kernels import glu
    from k3.kernels.glu import triton as glu_triton
    from k3.model.layers import GatedMLP

    kernel_env(K3_KERNELS="triton")
    calls = []
    real = glu_triton.c2_glu_triton
    monkeypatch.setattr(glu_triton, "c2_glu_triton", lambda *a: calls.append(1) or real(*a))
    gu = (torch.randn(5, 48) * torch.tensor([8.0] * 24 + [40.0] * 24)).to(DEV).requires_grad_()
    h = glu.c2_glu_packed(gu)
    assert calls == [1] and h.shape == (5, 24)
    (dgu,) = torch.autograd.grad(h.sum(), (gu,))
    gu64 = gu.detach().double().requires_grad_()
    h64 = c2_glu(gu64[:, :24], gu64[:, 24:])
    (dgu64,) = torch.autograd.grad(h64.sum(), (gu64,))
    for ref, out in ((h64, h), (dgu64, dgu)):
        assert ((ref - out.double()).norm() / ref.norm()).item() < 1e-5
    assert glu.c2_glu_packed(gu64).dtype == torch.float64 and calls == [1]
    mlp = GatedMLP(8, 24).to(DEV)
    mlp(torch.randn(3, 8, device=DEV))
    assert calls == [1, 1]
    kernel_env(K3_KERNELS="torch")
    torch.testing.assert_close(glu.c2_glu_packed(gu64), h64, rtol=0, atol=0)
    assert calls == [1, 1]
    with pytest.raises(ValueError, match="even last dim"):
        glu.c2_glu_packed(gu[:, :47])
