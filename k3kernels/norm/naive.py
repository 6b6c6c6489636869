"""The model's RMSNorm and the gated output RMSNorm of a KDA layer in plain PyTorch: the twins of the Triton kernels
(triton.py).

Legend: V the normalised (last) dimension, a head's value width; leading dimensions are rows.

    y = x rsqrt(mean_V(x^2) + eps) weight                  (rms_norm)
    y = o rsqrt(mean_V(o^2) + eps) weight sigmoid(gate)    (gated_rms_norm)

Computed in fp32 (float64 stays float64), returned in the input's dtype; `F.rms_norm` is fused on CUDA.
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm(x) * weight. x: [..., V]; weight: [V] -> y [..., V] in x's dtype (fp32 math; float64 stays).

    Example: rms_norm(torch.full((2, 4), 3.0), torch.ones(4)) is 1 everywhere (up to eps).
    """
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    # torch's rms_norm: the same equation (eps inside the root), one fused kernel on CUDA instead of ~6
    return F.rms_norm(xf, (xf.shape[-1],), weight.to(xf.dtype), eps).to(x.dtype)
