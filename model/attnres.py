"""Block Attention Residuals (architecture.md section 4; "Attention Residuals", arXiv 2603.15031).

Each sub-layer input is a softmax-over-depth mixture of the raw sources S = [b_0, ..., b_{n-1}, partial]:

    x = sum_i alpha_i v_i,   alpha = softmax_i( w . RMSNorm_key(v_i) )        (per token, softmax over sources)

with a zero-initialised pseudo-query w [d] (uniform mixture at init) and a key-norm gain g [d]. Because
RMSNorm_key(v) . w = (v . (g * w)) / rms(v), a mixture costs one matrix-vector product per source. The mixture
itself is the kernel op k3.kernels.attnres.attn_res_mix (the fused Triton kernel on the triton backend, the list form
on the torch backend, which keeps each source's rms on the source, so every mixture reading a completed block reuses
it); this module adds the stacked inference form and the pseudo-query parameter.

Legend: S sources, B batch, T tokens, D width.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.kernels.attnres import AttnResSource, acc_dtype, attn_res_mix, attn_res_weights, pseudo_query

__all__ = ["AttnResBlocks", "AttnResSource", "PseudoQuery", "attn_res_mix", "attn_res_mix_blocks", "attn_res_weights"]


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
        v = src.v.to(acc_dtype(src.v))[None]
        self.v = v if self.v is None else torch.cat([self.v, v])
        self.rms_inv = src.rms_inv[None] if self.rms_inv is None else torch.cat([self.rms_inv, src.rms_inv[None]])


def attn_res_mix_blocks(blocks: AttnResBlocks, partial: AttnResSource, norm_weight: torch.Tensor,
                        proj_weight: torch.Tensor) -> torch.Tensor:
    """attn_res_mix(blocks' sources + [partial]) from the stacked blocks: same equation, same accumulation dtype,
    only the summation order differs. Returns x [B, T, D] in the partial's dtype."""
    if blocks.v is None:  # one source: weight 1
        return partial.v
    dt = acc_dtype(partial.v)
    q = pseudo_query(norm_weight, proj_weight, dt)  # [D]
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
