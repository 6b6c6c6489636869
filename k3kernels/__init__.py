"""k3.kernels: the kernel core. Each op has a plain-PyTorch twin (`naive.py`); public ops are re-exported here, with
the process's kernel settings (`KernelConfig`, `configure`)."""

from .attnres import attn_res_mix
from .config import KernelConfig
from .conv import causal_conv1d, causal_conv1d_multi, short_conv
from .dispatch import configure
from .glu import c2_glu, swiglu
from .kda import chunk_kda, fused_recurrent_kda
from .loss import linear_cross_entropy
from .moe import moe_grouped_mm, moe_permute, moe_unpermute
from .norm import gated_rms_norm

__all__ = ["KernelConfig", "attn_res_mix", "c2_glu", "causal_conv1d", "causal_conv1d_multi", "chunk_kda", "configure",
           "fused_recurrent_kda", "gated_rms_norm", "linear_cross_entropy", "moe_grouped_mm", "moe_permute",
           "moe_unpermute", "short_conv", "swiglu"]
