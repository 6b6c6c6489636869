"""GLU activations: C2-GLU (bounded) and SwiGLU. Only the PyTorch twin exists so far (Triton: issue 4)."""

from .naive import c2_glu, swiglu

__all__ = ["c2_glu", "swiglu"]
