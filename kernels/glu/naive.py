"""C2-GLU (K3's tanh-bounded GLU, "SiTU") and SwiGLU in plain PyTorch; the reference twin of any fused kernel.

    h = [b1 * tanh(g / b1) * sigmoid(g)] * [b2 * tanh(u / b2)]     |h| < b1 * b2     (architecture.md section 8)

sigmoid takes the uncapped g. Computed in fp32 and returned in the input dtype.
"""

import torch


def c2_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """Bounded GLU activation. gate, up: [..., m] -> h [..., m] (dtype of gate).

    Example: c2_glu(torch.tensor([100.]), torch.tensor([1000.])) is just below 4 * 25 = 100.
    """
    g, u = gate.float(), up.float()
    h = beta1 * torch.tanh(g / beta1) * torch.sigmoid(g) * (beta2 * torch.tanh(u / beta2))
    return h.to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation SiLU(g) * u (the unbounded ablation baseline). gate, up: [..., m]."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)
