"""Causal depthwise short convolution (+ SiLU) with a carried tail; `short_conv` is the same op.

`causal_conv1d` and `causal_conv1d_multi` (several same-shape inputs, e.g. a KDA layer's q, k and v, in one launch)
dispatch through k3.kernels.dispatch: the Triton kernels (triton.py, forward and backward) on the "triton" backend,
the PyTorch twin (naive.py) otherwise, for float64, and for calls that carry a tail (inference).
"""

import torch

from k3.kernels.dispatch import resolve

from .naive import causal_conv1d as causal_conv1d_torch
from .naive import causal_conv1d_multi as causal_conv1d_multi_torch


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, *, activation: str | None = "silu",
                  initial_tail: torch.Tensor | None = None, output_final_tail: bool = False,
                  cu_seqlens: torch.Tensor | None = None):
    """Depthwise causal conv1d over T: x [B, T, C], weight [C, W] -> (y [B, T, C], final tail [N, W-1, C] or None).
    Arguments as `k3.kernels.conv.naive.causal_conv1d`. Example: y, _ = causal_conv1d(x, conv.weight[:, 0])."""
    return resolve("causal_conv1d", causal_conv1d_torch, like=x)(
        x, weight, activation=activation, initial_tail=initial_tail, output_final_tail=output_final_tail,
        cu_seqlens=cu_seqlens)


def causal_conv1d_multi(xs, weights, *, activation: str | None = "silu", cu_seqlens: torch.Tensor | None = None):
    """causal_conv1d of 1-3 same-shape inputs x [B, T, C], each with its own weight [C, W], no tails: the tuple of
    y [B, T, C]. Example: q, k, v = causal_conv1d_multi([q_pre, k_pre, v_pre], [wq, wk, wv])."""
    return resolve("causal_conv1d_multi", causal_conv1d_multi_torch, like=xs[0])(
        xs, weights, activation=activation, cu_seqlens=cu_seqlens)


short_conv = causal_conv1d

__all__ = ["causal_conv1d", "causal_conv1d_multi", "causal_conv1d_multi_torch", "causal_conv1d_torch", "short_conv"]
