"""Paged absorbed MLA decode as one Triton kernel (flash-decoding style online softmax over the page pool).

Legend as in naive.py (N sequences, T queries each, H heads, C latent, R rope, X = C + R, PS page size); BM =
next_pow2(max(16, T * H)) query rows per program (all heads and queries of one sequence share its keys, MQA-style,
so one program per sequence reads each latent once), BS = 64 keys per block (a page is a whole number of blocks:
PS % 64 == 0 in k3 serve), BC / BR = next_pow2 of C / R.

Per sequence: rows m = t * H + h; key blocks j0 = 0, 64, ... up to max_t qpos + 1, each read from its page
(block_table[n, j0 // PS], offset j0 % PS) without gathering the pages into a contiguous copy;
  s = scale (q_lat c_kv^T + q_rope k_rope^T) [BM, BS] fp32, masked to min_key <= j <= qpos[row];
  running max m, normaliser l and accumulator acc [BM, BC] fp32 (online softmax, Milakov & Gimelshein 2018);
  o_lat = acc / l, stored in q's dtype.
Split keys (flash-decoding, Dao et al. 2023 "Flash-Decoding for long-context inference"): with few sequences and
long contexts one program per sequence leaves most SMs idle, so the keys of each sequence can be split into S
ranges of KPS keys (a multiple of 64) over a grid (N, S); each program writes its partial (m, l, acc) to an fp32
workspace, and a combine step (PyTorch ops: M = max_s m_s, o = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s)
forms o_lat. S is a function of the static shapes (N and the block-table width), so CUDA graphs capture it; it is
1 (the single pass above) unless LAUNCH["split_keys"] is set, untimed yet.
The twin is naive.paged_mla_decode_torch (gather + one fp32 softmax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import check_device
from .naive import _check, paged_mla_decode_torch

BLOCK_KEYS = 64
# split_keys: 0 = one program per sequence (measured: 4-10x the gather twin on an H200); N = split a sequence's keys
# into ranges of N keys (a multiple of 64) when there are fewer than `split_below` sequences (benchmarks/mla_decode.py
# --split-keys compares). Off until timed.
LAUNCH: dict[str, int] = {"split_keys": 0, "split_below": 32}


# T (query tokens per sequence), min_key, G and KPS are runtime values, never specialised: a prefill tail after a
# prefix hit brings T = 2..64 tokens, and a T baked into the kernel (or Triton's value-1 / multiple-of-16
# specialisation) would compile a new kernel for each new tail length while the request waited, 1-5 s each on an
# H200 (k3-tiny). Only BM (16, 32 or 64 query rows) still selects a compiled variant; `warm_up` compiles them.
@triton.jit(do_not_specialize=["min_key", "G", "KPS", "T"])
def _paged_mla_kernel(q_lat, q_rope, kv, bt, qpos, o, ws_m, ws_l, ws_acc, scale, min_key, G, KPS,
                      T, H: tl.constexpr, C: tl.constexpr, R: tl.constexpr, PS: tl.constexpr,
                      BM: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr,
                      SPLIT: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1).to(tl.int64)  # key range [i_s * KPS, (i_s + 1) * KPS) with SPLIT, else all keys
    # no `.to` on T or the other integer arguments: inductor's launch of this kernel (torch.compile of the decode step)
    # passes them as Python ints, which have no `.to`; i_n is int64, so every offset below is
    # computed in int64 all the same
    scale = tl.full([], scale, tl.float32)  # fp64 when launched by inductor (torch.compile of the decode step)
    o_m = tl.arange(0, BM)
    m_row = o_m < T * H
    o_c = tl.arange(0, BC)
    m_c = o_c < C
    # q rows m = t * H + h are contiguous in [N, T, H, C]: row m of sequence n starts at (n * T * H + m) * C
    b_q = tl.load(q_lat + (i_n * T * H + o_m[:, None]) * C + o_c[None, :], mask=m_row[:, None] & m_c[None, :],
                  other=0.0)
    b_pos = tl.load(qpos + i_n * T + o_m // H, mask=m_row, other=-1).to(tl.int64)  # padded rows see no key
    n_keys = tl.max(b_pos, axis=0) + 1
    if R > 0:
        o_r = tl.arange(0, BR)
        m_r = o_r < R
        b_qr = tl.load(q_rope + (i_n * T * H + o_m[:, None]) * R + o_r[None, :],
                       mask=m_row[:, None] & m_r[None, :], other=0.0)
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BC], dtype=tl.float32)
    o_s = tl.arange(0, BS)
    j0 = 0
    j_end = n_keys
    if SPLIT:
        j0 = i_s * KPS
        j_end = tl.minimum(n_keys, j0 + KPS)
    while j0 < j_end:  # while, not range(): Triton's interpreter cannot range() over a runtime scalar
        page = tl.load(bt + i_n * G + j0 // PS).to(tl.int64)
        key = j0 + o_s  # [BS] absolute key positions
        m_key = key < j_end
        p_kv = (page * PS + (j0 % PS) + o_s[:, None]) * (C + R)
        b_ckv = tl.load(kv + p_kv + o_c[None, :], mask=m_key[:, None] & m_c[None, :], other=0.0)  # [BS, BC]
        b_s = tl.dot(b_q, tl.trans(b_ckv.to(b_q.dtype)), input_precision=PREC)
        if R > 0:
            b_kr = tl.load(kv + p_kv + C + o_r[None, :], mask=m_key[:, None] & m_r[None, :], other=0.0)
            b_s += tl.dot(b_qr, tl.trans(b_kr.to(b_qr.dtype)), input_precision=PREC)
        ok = (key[None, :] <= b_pos[:, None]) & (key[None, :] >= min_key)
        b_s = tl.where(ok, b_s * scale, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: keep everything at 0
        b_p = tl.exp(b_s - m_safe[:, None])
        alpha = tl.exp(b_m - m_safe)
        b_l = b_l * alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * alpha[:, None] + tl.dot(b_p.to(b_ckv.dtype), b_ckv, input_precision=PREC).to(tl.float32)
        b_m = m_new
        j0 += BS
    if SPLIT:  # partial results of this key range, combined outside (rows without keys here: m = -inf, l = 0)
        w = (i_n * tl.num_programs(1) + i_s) * BM + o_m  # [BM] workspace rows
        tl.store(ws_m + w, b_m)
        tl.store(ws_l + w, b_l)
        tl.store(ws_acc + w[:, None] * BC + o_c[None, :], b_acc)
    else:
        b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
        tl.store(o + (i_n * T * H + o_m[:, None]) * C + o_c[None, :], b_o.to(o.dtype.element_ty),
                 mask=m_row[:, None] & m_c[None, :])


def num_splits(N: int, G: int, PS: int) -> tuple[int, int]:
    """(S, keys per split) for N sequences over block tables of G pages of PS keys: (1, 0) = single pass. A function
    of the static shapes only, so a captured graph keeps its split."""
    kps = LAUNCH["split_keys"]
    if not kps or N >= LAUNCH["split_below"] or kps % BLOCK_KEYS:
        return 1, 0
    S = triton.cdiv(G * PS, kps)
    return (S, kps) if S > 1 else (1, 0)


def paged_mla_decode_triton(q_lat_NTHC: torch.Tensor, q_rope_NTHR: torch.Tensor, kv_pool_PSX: torch.Tensor,
                            block_table_NG: torch.Tensor, qpos_NT: torch.Tensor, *, scale: float,
                            min_key: int = 0) -> torch.Tensor:
    """Triton implementation behind `paged_mla_decode` (same arguments and result as paged_mla_decode_torch).

    float64 (reference precision), pages that are not a multiple of 64 tokens, or more than 64 query rows per
    sequence (T * H > 64: long verification windows) run on the twin."""
    _check(q_lat_NTHC, q_rope_NTHR, kv_pool_PSX, block_table_NG, qpos_NT)
    N, T, H, C = q_lat_NTHC.shape
    R = q_rope_NTHR.shape[-1]
    PS = kv_pool_PSX.shape[1]
    if q_lat_NTHC.dtype == torch.float64 or PS % BLOCK_KEYS or T * H > 64:
        return paged_mla_decode_torch(q_lat_NTHC, q_rope_NTHR, kv_pool_PSX, block_table_NG, qpos_NT, scale=scale,
                                      min_key=min_key)
    check_device("paged_mla_decode", q_lat_NTHC, q_rope_NTHR, kv_pool_PSX, block_table_NG, qpos_NT)
    q = q_lat_NTHC.contiguous()
    qr = q_rope_NTHR.to(q.dtype).contiguous()
    kv = kv_pool_PSX.contiguous()
    bt = block_table_NG.to(torch.int32).contiguous()
    pos = qpos_NT.to(torch.int32).contiguous()
    o = torch.empty_like(q)
    if N == 0 or T == 0:
        return o
    BM = max(16, triton.next_power_of_2(T * H))
    BC = max(16, triton.next_power_of_2(C))
    S, kps = num_splits(N, bt.shape[1], PS)
    ws_m = ws_l = ws_acc = o  # placeholders when not split (never dereferenced: SPLIT is a constexpr)
    if S > 1:
        f32 = torch.float32
        ws_m = torch.empty(N, S, BM, dtype=f32, device=q.device)
        ws_l = torch.empty(N, S, BM, dtype=f32, device=q.device)
        ws_acc = torch.empty(N, S, BM, BC, dtype=f32, device=q.device)
    _paged_mla_kernel[(N, S)](q, qr, kv, bt, pos, o, ws_m, ws_l, ws_acc, float(scale), int(min_key), bt.shape[1], kps,
                              T=T, H=H, C=C, R=R, PS=PS, BM=BM, BC=BC, BR=max(16, triton.next_power_of_2(max(R, 1))),
                              BS=BLOCK_KEYS, PREC="ieee" if q.dtype == torch.float32 else "tf32", SPLIT=S > 1,
                              num_warps=4 if C <= 256 else 8)
    if S > 1:  # combine the key ranges: o = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max_s m_s
        M = ws_m.amax(dim=1, keepdim=True)  # [N, 1, BM]
        w = torch.exp(ws_m - torch.where(M == float("-inf"), 0.0, M))  # [N, S, BM]; empty ranges weigh 0
        num = (w[..., None] * ws_acc).sum(1)  # [N, BM, BC]
        den = (w * ws_l).sum(1)  # [N, BM]
        o_rows = num / torch.where(den > 0, den, 1.0)[..., None]
        o.copy_(o_rows[:, :T * H, :C].view(N, T, H, C))
    return o


def warm_up(kv_pool_PSX: torch.Tensor, H: int, C: int, R: int, dtype: torch.dtype) -> None:
    """Compile every query-row variant (BM = 16, 32, 64) of the kernel for H heads, latent C, rope R over this pool
    now (a server's warm-up), so no request waits for a compile: T is a runtime value, BM = next_pow2(max(16, T * H))
    the only shape-dependent choice. One launch per variant at N = 1 on the pool's first page (keys read, nothing
    written to the pool). No-op where the Triton path does not apply (CPU tensors, float64, pages not a multiple of
    64)."""
    if kv_pool_PSX.device.type != "cuda" or dtype == torch.float64 or kv_pool_PSX.shape[1] % BLOCK_KEYS:
        return
    dev = kv_pool_PSX.device
    for BM in (16, 32, 64):
        T = BM // H if BM >= H else 0  # the largest T with next_pow2(max(16, T * H)) == BM
        if T < 1 or max(16, triton.next_power_of_2(T * H)) != BM:
            continue
        q = torch.zeros(1, T, H, C, dtype=dtype, device=dev)
        qr = torch.zeros(1, T, H, R, dtype=dtype, device=dev)
        pos = torch.arange(T, device=dev)[None]
        paged_mla_decode_triton(q, qr, kv_pool_PSX, torch.zeros(1, 1, dtype=torch.long, device=dev), pos, scale=1.0)
