"""GLU activations: C2-GLU (bounded), SwiGLU, and the GPT-OSS clamped SwiGLU (ablation comparison only).

Only the PyTorch twin exists so far (Triton: issue 4).
"""

from .naive import c2_glu, clamped_swiglu, swiglu

__all__ = ["c2_glu", "clamped_swiglu", "swiglu"]
