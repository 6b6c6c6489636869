"""Kimi Delta Attention kernels (kda.md): public ops and their plain-PyTorch reference twins.

Public ops (routed through k3.kernels.dispatch; layout [B, T, H, D]):
    chunk_kda            chunkwise form, training and prefill, autograd-capable
    fused_recurrent_kda  token recurrence, decode and short appends, optional in-place state pool
References: naive_recurrent_kda, naive_chunk_kda, naive_kda_gate, naive_kda_lowerbound_gate, l2norm.
"""

from .chunk import chunk_kda
from .fused_recurrent import fused_recurrent_kda
from .gate import l2norm, naive_kda_gate, naive_kda_lowerbound_gate
from .naive import naive_chunk_kda, naive_recurrent_kda

__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "l2norm",
    "naive_chunk_kda",
    "naive_kda_gate",
    "naive_kda_lowerbound_gate",
    "naive_recurrent_kda",
]
