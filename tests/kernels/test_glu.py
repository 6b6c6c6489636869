"""C2-GLU against its formula and the GPT-OSS clamped SwiGLU (architecture.md section 8)."""

import math

import pytest
import torch

from k3.kernels.glu import c2_glu, clamped_swiglu, swiglu

B1, B2 = 4.0, 25.0
GPT_OSS_MAX = 7 * (1 / (1 + math.exp(-1.702 * 7))) * 8  # 7 * sigmoid(11.914) * 8 ~= 55.9996


def c2_glu_reference(g, u, b1=B1, b2=B2):
    """Float64 restatement of h = [b1 tanh(g/b1) sigmoid(g)] [b2 tanh(u/b2)], with sigmoid written out."""
    g, u = g.double(), u.double()
    return b1 * torch.tanh(g / b1) / (1 + torch.exp(-g)) * b2 * torch.tanh(u / b2)


@pytest.mark.parametrize("std", [50.0, 200.0], ids=["std50", "std200"])
def test_bounds_at_large_inputs(std):
    g, u = torch.randn(2, 65536) * std
    h = c2_glu(g, u)
    assert 99.9 < float(h.abs().max()) <= B1 * B2  # reaches the bound, never exceeds it (fp32 rounds up to 100)
    h_clamped = clamped_swiglu(g, u)
    assert float(h_clamped.abs().max()) == pytest.approx(GPT_OSS_MAX, abs=1e-3)
    assert float(swiglu(g, u).abs().max()) > 1000  # the unbounded baseline really is unbounded here


def test_matches_float64_formula():
    g, u = torch.randn(2, 4096, dtype=torch.float64) * 10
    torch.testing.assert_close(c2_glu(g, u), c2_glu_reference(g, u), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(c2_glu(g.float(), u.float()).double(), c2_glu_reference(g, u), atol=1e-4, rtol=1e-5)
    hb = c2_glu(g.bfloat16(), u.bfloat16())
    assert hb.dtype == torch.bfloat16
    torch.testing.assert_close(hb.double(), c2_glu_reference(g.bfloat16(), u.bfloat16()), atol=0.5, rtol=1e-2)


def test_clamped_swiglu_matches_gpt_oss_formula():
    g, u = torch.randn(2, 4096, dtype=torch.float64) * 10
    gc, uc = g.clamp(max=7), u.clamp(-7, 7)
    torch.testing.assert_close(clamped_swiglu(g, u), gc / (1 + torch.exp(-1.702 * gc)) * (uc + 1))


def test_gate_part_is_silu_near_zero():
    g = torch.linspace(-0.05, 0.05, 2001, dtype=torch.float64)
    gate_part = B1 * torch.tanh(g / B1) * torch.sigmoid(g)
    assert float((gate_part - torch.nn.functional.silu(g)).abs().max()) < 2e-6
    # and the implemented c2_glu reduces to SwiGLU there (u small too: b2 tanh(u/b2) = u + O(u^3))
    u = torch.linspace(0.05, -0.05, 2001, dtype=torch.float64)
    assert float((c2_glu(g, u) - swiglu(g, u)).abs().max()) < 1e-7


def test_gradients_never_vanish_unlike_the_hard_clamp():
    g = torch.tensor([20.0, -20.0, 1.0, 1.0], requires_grad=True)
    u = torch.tensor([1.0, 1.0, 100.0, -100.0], requires_grad=True)
    dg, du = torch.autograd.grad(c2_glu(g, u).sum(), (g, u))
    assert bool((dg != 0).all()) and bool((du != 0).all()), (dg, du)
    assert dg.dtype == torch.float32

    dg_c, du_c = torch.autograd.grad(clamped_swiglu(g, u).sum(), (g, u))
    assert float(dg_c[0]) == 0.0  # gate clamped above at 7
    assert float(du_c[2]) == 0.0 and float(du_c[3]) == 0.0  # up clamped to [-7, 7]


def test_c2_glu_gradcheck():
    g = (torch.randn(3, 5, dtype=torch.float64) * 5).requires_grad_()
    u = (torch.randn(3, 5, dtype=torch.float64) * 30).requires_grad_()
    assert torch.autograd.gradcheck(c2_glu, (g, u))
