"""Block Attention Residuals mixing in plain PyTorch: the list-form twin of the fused kernel (triton.py) and the
reference of its tests (architecture.md section 4; "Attention Residuals", arXiv 2603.15031).

Each sub-layer input is a softmax-over-depth mixture of the raw sources v_1..v_S, per token:

    q = g * w,   logit_i = (v_i . q) * r_i,   r_i = 1 / sqrt(mean_d(v_i^2) + eps),   alpha = softmax_i(logit),
    x = sum_i alpha_i v_i

with the key-norm gain g [D] and the zero-initialised pseudo-query w [1, D]; RMSNorm_key(v) . w = (v . q) * r. The
per-source rms is computed on first use and kept on the source, so every mixture that reads a completed block
reuses it. Everything is accumulated in fp32 at least (float64 inputs stay float64, for the exactness tests).

Legend: S sources, B batch, T tokens, D width.
"""

from __future__ import annotations

import torch


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: fp32 at least, float64 inputs stay float64."""
    return torch.promote_types(t.dtype, torch.float32)


def pseudo_query(norm_weight: torch.Tensor, proj_weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q = g * w [D] in `dtype`: the key-norm gain folded into the pseudo-query."""
    return norm_weight.to(dtype) * proj_weight.reshape(-1).to(dtype)


class AttnResSource:
    """A source v [B, T, D] of the depth mixtures and its norm eps; `rms_inv` [B, T] (accumulation dtype) is
    computed on first use and then kept (the fused kernel never asks for it: it computes the rms in its pass over v).
    """

    __slots__ = ("_rms_inv", "eps", "v")

    def __init__(self, v: torch.Tensor, eps: float):
        self.v, self.eps, self._rms_inv = v, eps, None

    @property
    def rms_inv(self) -> torch.Tensor:
        if self._rms_inv is None:
            self._rms_inv = torch.rsqrt(self.v.to(acc_dtype(self.v)).pow(2).mean(-1) + self.eps)  # [B, T]
        return self._rms_inv


def attn_res_weights(sources: list[AttnResSource], norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """Depth-softmax weights alpha [S, B, T] (accumulation dtype), summing to 1 over S for every token.

    norm_weight: key-norm gain g [D] (`*_res_norm.weight`); proj_weight: pseudo-query w [1, D] (`*_res_proj.weight`).
    """
    dt = acc_dtype(sources[0].v)
    q = pseudo_query(norm_weight, proj_weight, dt)  # [D]
    logits = torch.stack([(s.v.to(dt) @ q) * s.rms_inv for s in sources])  # [S, B, T]
    return torch.softmax(logits, dim=0)


def attn_res_mix(sources: list[AttnResSource], norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """Mix sources into one sub-layer input x [B, T, D] in the first source's dtype.

    Example: attn_res_mix([AttnResSource(v, 1e-5) for v in vs], norm.weight, proj.weight)
    """
    alpha = attn_res_weights(sources, norm_weight, proj_weight)  # [S, B, T]
    x = sum(a.unsqueeze(-1) * s.v.to(alpha.dtype) for a, s in zip(alpha, sources))
    return x.to(sources[0].v.dtype)
