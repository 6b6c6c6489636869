"""Small shared layers: RMSNorm and the gated MLP (C2-GLU or SwiGLU) used by the dense layer, experts and MTP.

Legend: B batch, T tokens, D model width, F MLP width.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.kernels.glu import c2_glu, c2_glu_packed, swiglu
from k3.kernels.norm import rms_norm


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the op k3.kernels.norm.rms_norm: one fused pass each way in training on the triton backend (no fp32 copies
        # of the activations), the fp32 F.rms_norm twin otherwise
        return rms_norm(x, self.weight, self.eps)


def glu_activation(gate: torch.Tensor, up: torch.Tensor, act: str, beta1: float, beta2: float) -> torch.Tensor:
    """Dispatch on the config's `hidden_act` ("c2glu" | "swiglu")."""
    if act == "c2glu":
        return c2_glu(gate, up, beta1, beta2)
    return swiglu(gate, up)


def glu_activation_packed(gate_up: torch.Tensor, act: str, beta1: float, beta2: float) -> torch.Tensor:
    """glu_activation of a packed projection gate_up [..., 2F] laid out [gate | up] -> [..., F]: C2-GLU takes it
    whole (one gradient buffer, no concatenation of the halves' gradients in the backward)."""
    if act == "c2glu":
        return c2_glu_packed(gate_up, beta1, beta2)
    return swiglu(*gate_up.chunk(2, dim=-1))


class GatedMLP(nn.Module):
    """y = W_down act(W_gate x, W_up x), with W_gate and W_up packed as one [2F, D] weight `[gate | up]`.

    Names: `gate_up_proj` [2F, D], `down_proj` [D, F].
    """

    def __init__(self, d_in: int, d_ff: int, act: str = "c2glu", beta1: float = 4.0, beta2: float = 25.0):
        super().__init__()
        self.d_ff, self.act, self.beta1, self.beta2 = d_ff, act, beta1, beta2
        self.gate_up_proj = nn.Linear(d_in, 2 * d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_in, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        return self.down_proj(glu_activation_packed(self.gate_up_proj(x), self.act, self.beta1, self.beta2))
