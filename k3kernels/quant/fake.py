"""Fake quantization for quantization-aware training: the formats of naive.py applied in the forward, with a
straight-through estimator (STE) in the backward.

Forward: a weight [..., N, K] becomes exactly what its release dequantizes to (the same codes, scales and fp32
product as `quantize_weight` + `dequantize_weight`, so a converted model computes the bits the trained one did);
activations [..., I] get the format's per-token quantization (FP8 e4m3 for w4a8, none otherwise).
Backward (STE, Bengio et al. 2013, arXiv 1308.3432; the QAT form of Jacob et al. 2018, arXiv 1712.05877): the
upstream gradient passes where w / s lies inside the code range [qmin, qmax] and is zero where the clamp cut it;
the scales are functions of the weights treated as constants (no gradient through absmax). Activations pass the
gradient unchanged (their per-token scale never clips).

Learned int4 scales (`fake_quant_weight_lsq`, LSQ: Esser et al. 2019, "Learned Step Size Quantization", arXiv
1902.08153): the group scales s [..., G] are a tensor of their own, trained with the weights. Forward as above on s
(the release stores s, so it still computes the same bits). Backward, for r = w / s and q = clamp(round(r), -8, 7):

    dL/dw = g_up                                    where -8 <= r <= 7 (the STE), 0 elsewhere
    dL/ds = gs * sum_group g_up * (q - r)           inside (the rounding residual: LSQ's straight-through step)
                             g_up * q               outside (q is the clamp bound -8 or 7)

with LSQ's gradient scale gs = 1 / sqrt(group_size * 7). The edges r = -8 and r = 7 count as inside, as the STE mask
does (LSQ writes strict inequalities), so each element is either straight-through or clamped in both gradients.
A group whose scale is <= 0 outputs zeros and gets no gradient (all-zero groups start at scale 0 and stay there).

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
    _groups,
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


def lsq_grad_scale(group_size: int) -> float:
    """LSQ's gradient scale for a scale shared by `group_size` weights: 1 / sqrt(group_size * Q_P), Q_P = 7. Under
    AdamW it leaves the scale updates as they are (Adam divides a constant factor out); it keeps the scales'
    gradients from dominating the global grad-norm clip that the weights share."""
    return 1.0 / (group_size * INT4_MAX) ** 0.5


class _LearnedScaleInt4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, s, grad_scale):
        ctx.save_for_backward(w, s)
        ctx.grad_scale = grad_scale
        return int4_group_dequant(int4_group_codes(w.detach(), s.detach()), s.detach(), w.dtype)

    @staticmethod
    def backward(ctx, grad):
        w, s = ctx.saved_tensors
        # q and the mask from r exactly as int4_group_codes computes it (fp32), so both gradients see the forward's
        # codes; the residual q - r in float64 when the inputs are (references)
        group = w.shape[-1] // s.shape[-1]
        ct = torch.float64 if torch.float64 in (w.dtype, s.dtype, grad.dtype) else torch.float32
        live = (s.detach() > 0).unsqueeze(-1)
        safe = torch.where(live, s.detach().unsqueeze(-1), torch.ones_like(s.detach().unsqueeze(-1)))
        r32 = _groups(w.detach().float(), group) / safe.float()  # [..., G, g]
        q = torch.round(r32).clamp_(INT4_MIN, INT4_MAX)
        inside = (r32 >= INT4_MIN) & (r32 <= INT4_MAX) & live
        r = r32 if ct == torch.float32 else _groups(w.detach().to(ct), group) / safe.to(ct)
        d_s = torch.where(inside, q.to(ct) - r, q.to(ct)) * live  # outside: q is the clamp bound
        grad_s = (_groups(grad.to(ct), group) * d_s).sum(-1) * ctx.grad_scale
        return grad * inside.flatten(-2).to(grad.dtype), grad_s.to(s.dtype), None


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


def fake_quant_weight_lsq(w: torch.Tensor, scales: torch.Tensor, grad_scale: float | None = None) -> torch.Tensor:
    """Int4 quantize-dequantize of w [..., N, K] on learnable group scales [..., N, G] (module docstring, LSQ):
    differentiable in both. grad_scale: the factor on the scales' gradient, default lsq_grad_scale(K / G).
    Returns [..., N, K] in w's dtype: the bits a release with these codes and scales dequantizes to.

    Example: w_fq = fake_quant_weight_lsq(lin.weight, lin.weight_scales)   # lin.weight_scales.grad after backward
    """
    if not w.is_floating_point() or not scales.is_floating_point():
        raise ValueError(f"fake_quant_weight_lsq expects floating weights and scales, got {w.dtype}, {scales.dtype}")
    G = scales.shape[-1]
    if scales.shape[:-1] != w.shape[:-1] or G == 0 or w.shape[-1] % G:
        raise ValueError(f"int4 scales {tuple(scales.shape)} do not fit weights {tuple(w.shape)}: scales must be "
                         "[..., K / group_size] with the same leading dims")
    gs = lsq_grad_scale(w.shape[-1] // G) if grad_scale is None else grad_scale
    return _LearnedScaleInt4.apply(w, scales, gs)


def fake_quant_act(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The activation quantization of `fmt` on x [..., I] with an identity gradient: per-token FP8 e4m3 for w4a8,
    x itself for w4a16 / w8a16. Example: x_fq = fake_quant_act(x_MI, "w4a8")"""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; use one of {FORMATS}")
    return _FakeQuantFP8.apply(x) if fmt == "w4a8" else x


@dataclass(frozen=True)
class FakeQuant:
    """The fake quantizer a module's forward applies when its `fake_quant` attribute holds one (k3.model.quant):
    `weight(w, scales)` on each weight, `act(x)` on each input of a quantized matmul.

    learned: the int4 scales are parameters of the module (`<weight>_scales`, LSQ), passed as `scales`; otherwise
    they are the weights' absmax, recomputed on every call. scale_lr: the learning-rate multiplier the optimizer
    grouping gives those parameters (k3.train.optim).

    Example: FakeQuant("w4a8", 32).weight(w_NK)
    """

    fmt: str
    group_size: int | None
    learned: bool = False
    scale_lr: float = 1.0

    def weight(self, w: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
        if not self.learned:
            return fake_quant_weight(w, self.fmt, self.group_size)
        if scales is None:
            raise ValueError("FakeQuant(learned=True) needs the module's scales; enable_fake_quant registers them")
        return fake_quant_weight_lsq(w, scales)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant_act(x, self.fmt)
