"""Block Attention Residuals mixing (architecture.md 4): the softmax-over-depth mixture of a sub-layer's sources.

`attn_res_mix` dispatches through k3.kernels.dispatch: the fused Triton kernel (triton.py: every source in one pass,
each source's rms computed in that pass, a backward that recomputes the weights) on the "triton" backend, the
PyTorch list form (naive.py) otherwise and for float64 references.
"""

import torch

from k3.kernels.dispatch import resolve

from .naive import AttnResSource, acc_dtype, attn_res_weights, pseudo_query
from .naive import attn_res_mix as attn_res_mix_torch


def attn_res_mix(sources: list[AttnResSource], norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """Mix sources (each v [B, T, D]) into one sub-layer input x [B, T, D] in the first source's dtype, with the
    key-norm gain g [D] and the pseudo-query w [1, D]. Example: attn_res_mix(srcs, norm.weight, proj.weight)"""
    return resolve("attn_res_mix", attn_res_mix_torch, like=sources[0].v)(sources, norm_weight, proj_weight)


__all__ = ["AttnResSource", "acc_dtype", "attn_res_mix", "attn_res_mix_torch", "attn_res_weights", "pseudo_query"]
