"""C2-GLU (K3's tanh-bounded GLU, "SiTU"), SwiGLU and the GPT-OSS clamped SwiGLU in plain PyTorch.

These are the reference twins of any fused kernel (architecture.md section 8):

    C2-GLU:          h = [b1 * tanh(g / b1) * sigmoid(g)] * [b2 * tanh(u / b2)]        |h| < b1 * b2
    SwiGLU:          h = SiLU(g) * u                                                    unbounded
    clamped SwiGLU:  g <- min(g, L), u <- clamp(u, -L, L), h = g * sigmoid(a g) * (u + 1)   |h| <= ~56 at L = 7

sigmoid in C2-GLU takes the uncapped g. Everything is computed in fp32 (float64 inputs stay float64, so the
float64 references in the tests keep their precision) and returned in the gate's dtype.
Shapes: gate, up and h are all [..., m] (the gate and up halves of a packed `[gate | up]` projection).
"""

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """At least fp32: bf16/fp16 inputs are upcast, float64 stays float64."""
    return torch.promote_types(x.dtype, torch.float32)


def c2_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """Bounded GLU activation. gate, up: [..., m] -> h [..., m] (dtype of gate).

    Example: c2_glu(torch.tensor([100.]), torch.tensor([1000.])) is just below 4 * 25 = 100.
    """
    dt = _compute_dtype(gate)
    g, u = gate.to(dt), up.to(dt)
    h = beta1 * torch.tanh(g / beta1) * torch.sigmoid(g) * (beta2 * torch.tanh(u / beta2))
    return h.to(gate.dtype)


def c2_glu_packed(gate_up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """c2_glu of a packed [..., 2m] [gate | up] tensor: its halves through c2_glu."""
    gate, up = gate_up.chunk(2, dim=-1)
    return c2_glu(gate, up, beta1, beta2)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation SiLU(g) * u (the unbounded ablation baseline). gate, up: [..., m]."""
    dt = _compute_dtype(gate)
    return (torch.nn.functional.silu(gate.to(dt)) * up.to(dt)).to(gate.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """GPT-OSS clamped SwiGLU, an ablation/test comparison only (not selectable as `hidden_act`).

    gate, up: [..., m] -> h [..., m] (dtype of gate). Formula from openai/gpt-oss `gpt_oss/torch/model.py`
    (`swiglu`, `swiglu_limit` 7.0): the gate is clamped from above only, the up half on both sides, and the up half
    carries a +1. GPT-OSS interleaves gate/up columns in its weights; here the halves arrive already split.
    The hard clamp gives an exactly zero gradient outside the limit, unlike C2-GLU's tanh bound.

    Example: clamped_swiglu(torch.tensor([100.]), torch.tensor([100.])) == 7 * sigmoid(1.702 * 7) * 8 ~= 56.
    """
    dt = _compute_dtype(gate)
    g = gate.to(dt).clamp(max=limit)
    u = up.to(dt).clamp(min=-limit, max=limit)
    return (g * torch.sigmoid(alpha * g) * (u + 1.0)).to(gate.dtype)
