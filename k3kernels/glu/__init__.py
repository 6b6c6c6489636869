"""GLU activations: C2-GLU (bounded), SwiGLU, and the GPT-OSS clamped SwiGLU (ablation comparison only).

`c2_glu` dispatches through k3.kernels.dispatch: the fused Triton kernel (triton.py, one pass forward and one
backward, fp32 math) on the "triton" backend, the PyTorch twin (naive.py) otherwise and for float64 references.
"""

import torch

from k3.kernels.dispatch import resolve

from .naive import c2_glu as c2_glu_torch
from .naive import clamped_swiglu, swiglu


def c2_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """Bounded GLU beta1 tanh(g / beta1) sigmoid(g) * beta2 tanh(u / beta2). gate, up: [..., m] -> h [..., m]
    in gate's dtype (architecture.md 8). Example: c2_glu(torch.tensor([100.]), torch.tensor([1000.])) ~= 100."""
    return resolve("c2_glu", c2_glu_torch, like=gate)(gate, up, beta1, beta2)


__all__ = ["c2_glu", "c2_glu_torch", "clamped_swiglu", "swiglu"]
