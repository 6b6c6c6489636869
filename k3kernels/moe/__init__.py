"""MoE token dispatch: permute by expert, grouped matmul, weighted unpermute (the combine).

`moe_unpermute` dispatches through k3.kernels.dispatch: the fused Triton combine (triton_combine.py, one pass
forward and one backward) in training on the "triton" backend, the PyTorch twin (naive.py) otherwise.
"""

import torch

from k3.kernels.dispatch import resolve

from .naive import grouped_mm_available, moe_grouped_mm, moe_permute
from .naive import moe_unpermute as moe_unpermute_torch


def moe_unpermute(y_MO: torch.Tensor, order_M: torch.Tensor, topk_weight_NK: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's K expert outputs: out[n] = sum_k w[n, k] y[row of (n, k)] -> [N, O] in y's
    dtype (`k3.kernels.moe.naive.moe_unpermute` for the full contract).
    Example: out = moe_unpermute(y_MO, order_M, w_NK)."""
    return resolve("moe_unpermute", moe_unpermute_torch, like=y_MO)(y_MO, order_M, topk_weight_NK)


__all__ = ["grouped_mm_available", "moe_grouped_mm", "moe_permute", "moe_unpermute", "moe_unpermute_torch"]
