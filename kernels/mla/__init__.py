"""Paged absorbed MLA attention for serving decode / verification (`paged_mla_decode`), dispatched through
k3.kernels.dispatch: the Triton kernel (triton_decode.py) on the "triton" backend, the PyTorch twin otherwise."""

import torch

from k3.kernels.dispatch import resolve

from .naive import paged_mla_decode_torch


def paged_mla_decode(q_lat_NTHC: torch.Tensor, q_rope_NTHR: torch.Tensor, kv_pool_PSX: torch.Tensor,
                     block_table_NG: torch.Tensor, qpos_NT: torch.Tensor, *, scale: float,
                     min_key: int = 0) -> torch.Tensor:
    """Absorbed MLA of N sequences' T queries over their paged latents -> o_lat [N, T, H, C] (see naive.py)."""
    impl = resolve("paged_mla_decode", paged_mla_decode_torch, like=q_lat_NTHC)
    return impl(q_lat_NTHC, q_rope_NTHR, kv_pool_PSX, block_table_NG, qpos_NT, scale=scale, min_key=min_key)


def warm_up_paged_mla_decode(kv_pool_PSX: torch.Tensor, H: int, C: int, R: int, dtype: torch.dtype) -> None:
    """Compile the Triton kernel's variants for this pool and head shape now (serving warm-up); no-op on the PyTorch
    backend or where the Triton path does not apply (triton_decode.warm_up)."""
    if resolve("paged_mla_decode", paged_mla_decode_torch, like=kv_pool_PSX) is not paged_mla_decode_torch:
        from .triton_decode import warm_up

        warm_up(kv_pool_PSX, H, C, R, dtype)


__all__ = ["paged_mla_decode", "paged_mla_decode_torch", "warm_up_paged_mla_decode"]
