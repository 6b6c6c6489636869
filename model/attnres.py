"""Block Attention Residuals (architecture.md section 4; "Attention Residuals", arXiv 2603.15031).

Each sub-layer input is a softmax-over-depth mixture of the raw sources S = [b_0, ..., b_{n-1}, partial]:

    x = sum_i alpha_i v_i,   alpha = softmax_i( w . RMSNorm_key(v_i) )        (per token, softmax over sources)

with a zero-initialised pseudo-query w [d] (uniform mixture at init) and a key-norm gain g [d]. Because
RMSNorm_key(v) . w = (v . (g * w)) / rms(v), the per-source rms is computed once per source and reused by every
sub-layer that reads it (completed blocks never change), so a mixture costs one matrix-vector product per source.

Legend: S sources, B batch, T tokens, D width.
"""

from __future__ import annotations

import torch
from torch import nn


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulate in fp32 at least (float64 inputs stay float64, for the exactness tests)."""
    return torch.promote_types(t.dtype, torch.float32)


class AttnResSource:
    """A source tensor v [B, T, D] with its cached rms [B, T] (fp32)."""

    __slots__ = ("rms_inv", "v")

    def __init__(self, v: torch.Tensor, eps: float):
        self.v = v
        vf = v.to(_acc_dtype(v))
        self.rms_inv = torch.rsqrt(vf.pow(2).mean(-1) + eps)  # [B, T]


def attn_res_weights(sources: list[AttnResSource], norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """Depth-softmax weights alpha [S, B, T] (fp32), summing to 1 over S for every token.

    norm_weight: key-norm gain g [D] (`*_res_norm.weight`); proj_weight: pseudo-query w [1, D] (`*_res_proj.weight`).
    """
    dt = _acc_dtype(sources[0].v)
    q = norm_weight.to(dt) * proj_weight.reshape(-1).to(dt)  # [D]
    logits = torch.stack([(s.v.to(dt) @ q) * s.rms_inv for s in sources])  # [S, B, T]
    return torch.softmax(logits, dim=0)


def attn_res_mix(sources: list[AttnResSource], norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """Mix sources into one sub-layer input x [B, T, D] (sources' dtype)."""
    alpha = attn_res_weights(sources, norm_weight, proj_weight)  # [S, B, T]
    x = sum(a.unsqueeze(-1) * s.v.to(alpha.dtype) for a, s in zip(alpha, sources))
    return x.to(sources[0].v.dtype)


class AttnResBlocks:
    """The completed blocks as one stack for inference: v [nb, B, T, D] in the accumulation dtype and rms_inv
    [nb, B, T], grown once per completed block. A mixture over them then costs a fixed handful of kernels whatever the
    number of sources, where the list form issues ~6 per source (a k3-small decode step ran ~2,600 kernels, most of
    them per-source mixture ops). Not for training: autograd would keep every re-stacked copy."""

    __slots__ = ("rms_inv", "v")

    def __init__(self):
        self.v: torch.Tensor | None = None
        self.rms_inv: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.v is None else self.v.shape[0]

    def append(self, src: AttnResSource) -> None:
        v = src.v.to(_acc_dtype(src.v))[None]
        self.v = v if self.v is None else torch.cat([self.v, v])
        self.rms_inv = src.rms_inv[None] if self.rms_inv is None else torch.cat([self.rms_inv, src.rms_inv[None]])


def attn_res_mix_blocks(blocks: AttnResBlocks, partial: AttnResSource, norm_weight: torch.Tensor,
                        proj_weight: torch.Tensor) -> torch.Tensor:
    """attn_res_mix(blocks' sources + [partial]) from the stacked blocks: same equation, same accumulation dtype,
    only the summation order differs. Returns x [B, T, D] in the partial's dtype."""
    if blocks.v is None:  # one source: weight 1
        return partial.v
    dt = _acc_dtype(partial.v)
    q = norm_weight.to(dt) * proj_weight.reshape(-1).to(dt)  # [D]
    pv = partial.v.to(dt)  # [B, T, D]
    logit_p = (pv @ q) * partial.rms_inv  # [B, T]
    logits = torch.cat([(blocks.v @ q) * blocks.rms_inv, logit_p[None]])  # [nb + 1, B, T]
    alpha = torch.softmax(logits, dim=0)
    x = (alpha[:-1, ..., None] * blocks.v).sum(0) + alpha[-1, ..., None] * pv
    return x.to(partial.v.dtype)


class PseudoQuery(nn.Module):
    """Holds the zero-initialised pseudo-query `weight` [1, D] (K3 name `*_res_proj.weight`). Trained with AdamW."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, dim))
