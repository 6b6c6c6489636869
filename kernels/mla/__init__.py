"""Paged absorbed MLA attention for serving decode / verification (`paged_mla_decode`), dispatched through
k3.kernels.dispatch: the Triton kernel (triton_decode.py) on the "triton" backend, the PyTorch twin otherwise."""

import torch

from k3.kernels.dispatch import resolve

from .naive import paged_mla_decode_torch


def paged_mla_decode(q_lat_NTHC: torch.Tensor, q_rope_NTHR: torch.Tensor, kv_pool_PSX: torch.Tensor,
                     block_table_NG: torch.Tensor, qpos_NT: torch.Tensor, *, scale: float,
                     min_key: int = 0) -> torch.Tensor:
    """Absorbed MLA of N sequences' T queries over their paged latents -> o_lat [N, T, H, C] (see naive.py)."""
    impl = resolve("paged_mla_decode", paged_mla_decode_torch)
    return impl(q_lat_NTHC, q_rope_NTHR, kv_pool_PSX, block_table_NG, qpos_NT, scale=scale, min_key=min_key)


__all__ = ["paged_mla_decode", "paged_mla_decode_torch"]
