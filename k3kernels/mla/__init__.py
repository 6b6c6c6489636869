"""MLA kernels, dispatched through k3.kernels.dispatch (the Triton kernel on the "triton" backend, the PyTorch twin
otherwise): paged absorbed attention for serving decode / verification (`paged_mla_decode`, triton_decode.py) and
the per-head max causal logit of a training forward (`causal_max_logit`, triton_max_logit.py; QK-Clip reads it)."""

import torch

from k3.kernels.dispatch import resolve

from .naive import causal_max_logit_torch, paged_mla_decode_torch


def paged_mla_decode(q_lat_NTHC: torch.Tensor, q_rope_NTHR: torch.Tensor, kv_pool_PSX: torch.Tensor,
                     block_table_NG: torch.Tensor, qpos_NT: torch.Tensor, *, scale: float,
                     min_key: int = 0) -> torch.Tensor:
    """Absorbed MLA of N sequences' T queries over their paged latents -> o_lat [N, T, H, C] (see naive.py)."""
    impl = resolve("paged_mla_decode", paged_mla_decode_torch, like=q_lat_NTHC)
    return impl(q_lat_NTHC, q_rope_NTHR, kv_pool_PSX, block_table_NG, qpos_NT, scale=scale, min_key=min_key)


def causal_max_logit(q_BTHE: torch.Tensor, k_BSHE: torch.Tensor, scale: float, q_start: int = 0) -> torch.Tensor:
    """Per-head max over valid causal pairs of scale·q·k -> [H] fp32 (float64 inputs: float64), see
    naive.causal_max_logit_torch."""
    impl = resolve("causal_max_logit", causal_max_logit_torch, like=q_BTHE)
    return impl(q_BTHE, k_BSHE, scale, q_start)


def warm_up_paged_mla_decode(kv_pool_PSX: torch.Tensor, H: int, C: int, R: int, dtype: torch.dtype) -> None:
    """Compile the Triton kernel's variants for this pool and head shape now (serving warm-up); no-op on the PyTorch
    backend or where the Triton path does not apply (triton_decode.warm_up)."""
    if resolve("paged_mla_decode", paged_mla_decode_torch, like=kv_pool_PSX) is not paged_mla_decode_torch:
        from .triton_decode import warm_up

        warm_up(kv_pool_PSX, H, C, R, dtype)


__all__ = ["causal_max_logit", "causal_max_logit_torch", "paged_mla_decode", "paged_mla_decode_torch",
           "warm_up_paged_mla_decode"]
