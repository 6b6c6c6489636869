"""Paged absorbed MLA attention for decode and speculative verification: the PyTorch twin of triton_decode.py.

Legend: N sequences, T queries per sequence (1 for decode, 1 + drafts for verification), H heads, C kv_lora_rank,
R rope dim (0 = pure NoPE), X = C + R latent width, P pages in the pool, PS tokens per page, G pages per sequence.

The latent cache lives in a page pool kv_pool [P, PS, X] (k3.serve.cache.PagePool); sequence n's key j sits at
kv_pool[block_table[n, j // PS], j % PS]. Query (n, t) at absolute position qpos[n, t] sees keys
min_key .. qpos[n, t] (architecture.md 6.2; the MTP layer masks its empty slot 0 with min_key = 1):

    logit = scale (q_lat . c_kv_j + q_rope . k_rope_j),   o_lat = softmax_j(logit) c_kv        (fp32 softmax)
"""

from __future__ import annotations

import torch


def paged_mla_decode_torch(q_lat_NTHC: torch.Tensor, q_rope_NTHR: torch.Tensor, kv_pool_PSX: torch.Tensor,
                           block_table_NG: torch.Tensor, qpos_NT: torch.Tensor, *, scale: float,
                           min_key: int = 0) -> torch.Tensor:
    """Absorbed MLA over paged latents. Returns o_lat [N, T, H, C] in q's dtype.

    Gathers each sequence's G pages ([N, G * PS, X], pages past the sequence's length are masked), then one masked
    softmax in fp32. Example: o = paged_mla_decode_torch(q_lat, q_rope, pool.kv[0], bt, pos, scale=1 / 14.0)
    """
    C, R = q_lat_NTHC.shape[-1], q_rope_NTHR.shape[-1]
    _check(q_lat_NTHC, q_rope_NTHR, kv_pool_PSX, block_table_NG, qpos_NT)
    kv_NSX = kv_pool_PSX[block_table_NG.long()].flatten(1, 2).float()  # [N, G * PS, X]
    c_kv, k_rope = kv_NSX.split([C, R], dim=-1)
    logits = torch.einsum("nthc,nsc->nhts", q_lat_NTHC.float(), c_kv)
    if R:
        logits = logits + torch.einsum("nthr,nsr->nhts", q_rope_NTHR.float(), k_rope)
    logits = logits * scale
    key = torch.arange(kv_NSX.shape[1], device=kv_NSX.device)[None, None, :]
    valid = (key <= qpos_NT.long()[:, :, None]) & (key >= min_key)  # [N, T, S]
    probs = torch.softmax(logits.masked_fill(~valid[:, None], float("-inf")), dim=-1)
    return torch.einsum("nhts,nsc->nthc", probs, c_kv).to(q_lat_NTHC.dtype)


def _check(q_lat, q_rope, kv_pool, block_table, qpos) -> None:
    """Shapes only (no data-dependent checks: the serving engine calls this inside CUDA graphs)."""
    def need(cond, msg):
        if not cond:
            raise ValueError(f"paged_mla_decode: {msg}")

    need(q_lat.dim() == 4, f"q_lat must be [N, T, H, C], got {tuple(q_lat.shape)}")
    N, T, H, C = q_lat.shape
    need(q_rope.dim() == 4 and tuple(q_rope.shape[:3]) == (N, T, H),
         f"q_rope must be [N={N}, T={T}, H={H}, R], got {tuple(q_rope.shape)}")
    R = q_rope.shape[3]
    need(kv_pool.dim() == 3 and kv_pool.shape[2] == C + R,
         f"kv_pool must be [P, page, C + R = {C + R}], got {tuple(kv_pool.shape)}")
    need(block_table.dim() == 2 and block_table.shape[0] == N and not block_table.is_floating_point(),
         f"block_table must be an integer [N={N}, G] tensor, got {tuple(block_table.shape)} {block_table.dtype}")
    need(tuple(qpos.shape) == (N, T) and not qpos.is_floating_point(),
         f"qpos must be an integer [N={N}, T={T}] tensor, got {tuple(qpos.shape)} {qpos.dtype}")


# Query rows per chunk when materializing logits for the max-logit statistic: bounds the chunk at ~2^24 fp32 values.
_MAX_LOGIT_CHUNK_ELEMS = 1 << 24


def causal_max_logit_torch(q_BTHE: torch.Tensor, k_BSHE: torch.Tensor, scale: float, q_start: int) -> torch.Tensor:
    """Per-head max of the scaled logits scale·q·k over valid causal pairs, fp32 [H] (float64 for float64 inputs),
    the logits materialised in chunks of queries; the twin of triton_max_logit.py.

    Query t sits at absolute position q_start + t and sees keys 0 .. q_start + t (k has S = q_start + T rows).
    Example: causal_max_logit_torch(q, k, 1 / math.sqrt(E), 0)  # training: q and k over the same T tokens
    """
    B, T, H, _ = q_BTHE.shape
    S = k_BSHE.shape[1]
    f = torch.float64 if torch.float64 in (q_BTHE.dtype, k_BSHE.dtype) else torch.float32
    k_BHSE = k_BSHE.to(f).transpose(1, 2)
    key_pos_S = torch.arange(S, device=q_BTHE.device)
    chunk = max(1, _MAX_LOGIT_CHUNK_ELEMS // max(1, B * H * S))
    out_H = torch.full((H,), float("-inf"), device=q_BTHE.device, dtype=f)
    for t0 in range(0, T, chunk):
        q_BHcE = q_BTHE[:, t0:t0 + chunk].to(f).transpose(1, 2)
        logits_BHcS = torch.matmul(q_BHcE, k_BHSE.transpose(-1, -2)) * scale
        q_pos_c = q_start + torch.arange(t0, t0 + q_BHcE.shape[2], device=q_BTHE.device)
        valid_cS = key_pos_S[None, :] <= q_pos_c[:, None]
        logits_BHcS = logits_BHcS.masked_fill(~valid_cS, float("-inf"))
        out_H = torch.maximum(out_H, logits_BHcS.amax(dim=(0, 2, 3)))
    return out_H
