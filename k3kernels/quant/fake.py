"""Fake quantization for quantization-aware training: the formats of naive.py applied in the forward, with a
straight-through estimator (STE) in the backward.

Forward: a weight [..., N, K] becomes exactly what its release dequantizes to (the same codes, scales and fp32
product as `quantize_weight` + `dequantize_weight`, so a converted model computes the bits the trained one did);
activations [..., I] get the format's per-token quantization (FP8 e4m3 for w4a8, none otherwise).
Backward (STE, Bengio et al. 2013, arXiv 1308.3432; the QAT form of Jacob et al. 2018, arXiv 1712.05877): the
upstream gradient passes where w / s lies inside the code range [qmin, qmax] and is zero where the clamp cut it;
the scales are functions of the weights treated as constants (no gradient through absmax). Activations pass the
gradient unchanged (their per-token scale never clips).

Legend: N out-features, K in-features, G = K / group_size, I activation features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .naive import (
    FORMATS,
    INT4_FORMATS,
    INT4_MAX,
    INT4_MIN,
    INT8_MAX,
    fake_quant_fp8_per_token,
    int4_group_codes,
    int4_group_dequant,
    int4_group_scales,
)


def _int4_fake(w: torch.Tensor, group_size: int, scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    s_G = int4_group_scales(w, group_size) if scales is None else scales.float()
    out = int4_group_dequant(int4_group_codes(w, s_G), s_G, w.dtype)
    safe = torch.where(s_G > 0, s_G, torch.ones_like(s_G))
    r = w.detach().float().reshape(*s_G.shape, -1) / safe.unsqueeze(-1)
    inside = ((r >= INT4_MIN) & (r <= INT4_MAX)).flatten(-2)
    return out, inside


def _int8_fake(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ct = torch.float64 if w.dtype == torch.float64 else torch.float32
    wf = w.detach().to(ct)
    s = wf.abs().amax(-1, keepdim=True) / INT8_MAX
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(wf / safe).clamp_(-INT8_MAX, INT8_MAX)
    return (q * s).to(w.dtype), torch.ones_like(w, dtype=torch.bool)  # per-channel absmax: nothing is clipped


class _FakeQuantWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, fmt, group_size, scales):
        out, inside = _int4_fake(w, group_size, scales) if fmt in INT4_FORMATS else _int8_fake(w)
        ctx.save_for_backward(inside)
        return out

    @staticmethod
    def backward(ctx, grad):
        (inside,) = ctx.saved_tensors
        return grad * inside.to(grad.dtype), None, None, None


class _FakeQuantFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return fake_quant_fp8_per_token(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def fake_quant_weight(w: torch.Tensor, fmt: str, group_size: int | None,
                      scales: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize a weight [..., N, K] in format `fmt` with the STE backward (module docstring).

    group_size: the int4 group (ignored by the per-channel w8a16); scales: optional fixed int4 scales [..., G]
    (default: RTN, absmax / 7 per group of the current weights). Returns [..., N, K] in w's dtype.

    Example: w_fq = fake_quant_weight(experts.gate_up_proj, "w4a8", 32)   # differentiable in the weight
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; use one of {FORMATS}")
    if not w.is_floating_point():
        raise ValueError(f"fake_quant_weight expects floating weights, got {w.dtype}")
    return _FakeQuantWeight.apply(w, fmt, group_size, scales)


def fake_quant_act(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The activation quantization of `fmt` on x [..., I] with an identity gradient: per-token FP8 e4m3 for w4a8,
    x itself for w4a16 / w8a16. Example: x_fq = fake_quant_act(x_MI, "w4a8")"""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; use one of {FORMATS}")
    return _FakeQuantFP8.apply(x) if fmt == "w4a8" else x


@dataclass(frozen=True)
class FakeQuant:
    """The fake quantizer a module's forward applies when its `fake_quant` attribute holds one (k3.model.quant):
    `weight(w)` on each weight, `act(x)` on each input of a quantized matmul.

    Example: FakeQuant("w4a8", 32).weight(w_NK)
    """

    fmt: str
    group_size: int | None

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        return fake_quant_weight(w, self.fmt, self.group_size)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant_act(x, self.fmt)
