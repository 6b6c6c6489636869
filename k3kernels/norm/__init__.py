"""Normalisations: the model's RMSNorm and the gated output RMSNorm of KDA layers.

`rms_norm` and `gated_rms_norm` dispatch through k3.kernels.dispatch: the fused Triton kernel (triton.py, one pass forward and
one backward, fp32 math) on the "triton" backend, the PyTorch twin (naive.py) otherwise and for float64.
"""

import torch

from k3.kernels.dispatch import resolve

from .naive import gated_rms_norm as gated_rms_norm_torch
from .naive import rms_norm as rms_norm_torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm(x) * weight: x [..., V], weight [V] -> y [..., V] in x's dtype (fp32 math). The Triton kernel serves
    training on the "triton" backend (inference stays on the twin's one fused CUDA op).
    Example: y = rms_norm(x_BTD, norm.weight, 1e-5)."""
    return resolve("rms_norm", rms_norm_torch, like=x)(x, weight, eps)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm(o) * weight * sigmoid(gate): o, gate [..., V], weight [V] -> y [..., V] in o's dtype (fp32 math).
    Example: y = gated_rms_norm(o_BTHV, gate_BTHV, norm.weight, 1e-5)."""
    return resolve("gated_rms_norm", gated_rms_norm_torch, like=o)(o, gate, weight, eps)


__all__ = ["gated_rms_norm", "gated_rms_norm_torch", "rms_norm", "rms_norm_torch"]
