"""Block AttnRes's list-form twin (k3.kernels.attnres.naive, what the model runs on the torch backend) against the
paper's form in float64 (architecture.md 4.1: alpha = softmax_i(w . RMSNorm_key(v_i)) written with torch's rms_norm,
not the folded q = g * w), and the model's use of the kernel op."""

import torch
import torch.nn.functional as F

import k3.kernels.attnres as kernel_attnres
import k3.model.attnres as model_attnres
from k3.kernels.attnres.naive import AttnResSource, attn_res_mix


def test_twin_equals_the_paper_form_in_float64():
    gen = torch.Generator().manual_seed(0)
    vs = [torch.randn(2, 7, 24, generator=gen, dtype=torch.float64) * (1 + i) for i in range(4)]
    g = torch.rand(24, generator=gen, dtype=torch.float64) + 0.5
    w = torch.randn(1, 24, generator=gen, dtype=torch.float64)
    alpha = torch.softmax(torch.stack([F.rms_norm(v, (24,), g, 1e-5) @ w[0] for v in vs]), 0)  # [S, B, T]
    want = sum(a[..., None] * v for a, v in zip(alpha, vs))
    got = attn_res_mix([AttnResSource(v, 1e-5) for v in vs], g, w)
    assert got.dtype == torch.float64 and (got - want).abs().max().item() < 1e-12


def test_source_rms_is_computed_on_first_use_and_kept():
    v = torch.randn(2, 3, 8)
    src = AttnResSource(v, 1e-5)
    assert src._rms_inv is None  # the fused kernel never asks for it
    r = src.rms_inv
    assert r is src.rms_inv and r.shape == (2, 3)
    torch.testing.assert_close(r, v.pow(2).mean(-1).add(1e-5).rsqrt())


def test_the_model_mixes_through_the_kernel_op():
    """One copy of the math: k3.model.attnres re-exports the kernel op and the twin's source type."""
    assert model_attnres.attn_res_mix is kernel_attnres.attn_res_mix
    assert model_attnres.AttnResSource is AttnResSource
