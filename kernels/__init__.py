"""k3.kernels: the kernel core. Each op has a plain-PyTorch twin (`naive.py`); public ops are re-exported here, with
the process's kernel settings (`KernelConfig`, `configure`)."""

from .config import KernelConfig
from .conv import causal_conv1d, short_conv
from .dispatch import configure
from .glu import c2_glu, swiglu
from .kda import chunk_kda, fused_recurrent_kda
from .moe import moe_grouped_mm, moe_permute, moe_unpermute

__all__ = ["KernelConfig", "c2_glu", "causal_conv1d", "chunk_kda", "configure", "fused_recurrent_kda",
           "moe_grouped_mm", "moe_permute", "moe_unpermute", "short_conv", "swiglu"]
