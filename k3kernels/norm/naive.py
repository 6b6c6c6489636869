"""The gated output RMSNorm of a KDA layer in plain PyTorch: the reference twin of the Triton kernel (triton.py).

Legend: V the normalised (last) dimension, a head's value width; leading dimensions are rows.

    y = o rsqrt(mean_V(o^2) + eps) weight sigmoid(gate)

Computed in fp32 (float64 stays float64), returned in o's dtype; `F.rms_norm` is fused on CUDA.
"""

import torch
import torch.nn.functional as F


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm(o) * weight * sigmoid(gate). o, gate: [..., V]; weight: [V] -> y [..., V] in o's dtype.

    Example: gated_rms_norm(torch.ones(2, 4), torch.zeros(2, 4), torch.ones(4)) is 0.5 everywhere (up to eps).
    """
    dt = torch.promote_types(o.dtype, torch.float32)  # fp32, or float64 for float64 models
    y = F.rms_norm(o.to(dt), (o.shape[-1],), weight.to(dt), eps)
    return (y * torch.sigmoid(gate.to(dt))).to(o.dtype)
