"""MoE token dispatch: permute by expert, grouped matmul, weighted unpermute. PyTorch twin only so far."""

from .naive import grouped_mm_available, moe_grouped_mm, moe_permute, moe_unpermute

__all__ = ["grouped_mm_available", "moe_grouped_mm", "moe_permute", "moe_unpermute"]
