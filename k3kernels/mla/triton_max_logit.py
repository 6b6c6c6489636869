"""Per-head max of the causal attention logits (QK-Clip's statistic, k3.train.optim.qk_clip_) as one Triton kernel.

Legend: B batch, T queries, S keys (S = q_start + T in training), H heads, E = nope + rope head dim, BE =
next_pow2(E), BM query rows and BN keys per block. Program (b * H + h, query block i): q [BM, BE] stays in
registers; over the key blocks up to the block's last query position,
  s = q k^T [BM, BN] (tensor cores, fp32 accumulation; full fp32 for fp32 inputs), masked to key <= q_start + t,
  running row max;
the block's max goes to a [B * H, n_blocks] fp32 workspace, reduced outside to [H] and scaled (scale > 0, so
max(scale s) = scale max(s) exactly: rounding is monotone).
Why: the twin (naive.causal_max_logit_torch) materialises every logit in fp32, chunked over queries: at k3-small's
4 x 4,096 tokens that is a 155 GFLOP fp32 matmul and ~3 GB of logits written and read per MLA layer, five layers a
training forward; this is the QK^T of flash attention without the softmax, nothing written but [B * H, n_blocks].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import check_device
from .naive import causal_max_logit_torch

BLOCK_M = 64
BLOCK_N = 64


# T, S and q_start are runtime values: a new sequence length needs no new compile
@triton.jit(do_not_specialize=["T", "S", "q_start"])
def _max_logit_kernel(q, k, ws, T, S, q_start, s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, n_blocks,
                      H: tl.constexpr, E: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      PREC: tl.constexpr):
    i_bh = tl.program_id(0).to(tl.int64)
    i_m = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    o_m = i_m * BM + tl.arange(0, BM)
    m_row = o_m < T
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    b_q = tl.load(q + i_b * s_qb + o_m[:, None] * s_qt + i_h * s_qh + o_e[None, :],
                  mask=m_row[:, None] & m_e[None, :], other=0.0)
    q_pos = q_start + o_m  # [BM] absolute positions; query t sees keys 0 .. q_pos[t]
    n_keys = tl.minimum(S, q_start + tl.minimum((i_m + 1) * BM, T))
    b_max = tl.full([BM], float("-inf"), dtype=tl.float32)
    o_n = tl.arange(0, BN)
    j0 = 0
    while j0 < n_keys:  # while, not range(): the interpreter cannot range() over a runtime scalar
        key = j0 + o_n
        b_k = tl.load(k + i_b * s_kb + key[:, None] * s_kt + i_h * s_kh + o_e[None, :],
                      mask=(key < S)[:, None] & m_e[None, :], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        ok = (key[None, :] <= q_pos[:, None]) & (key[None, :] < S) & m_row[:, None]
        b_max = tl.maximum(b_max, tl.max(tl.where(ok, b_s, float("-inf")), axis=1))
        j0 += BN
    tl.store(ws + i_bh * n_blocks + i_m, tl.max(b_max, axis=0))


def causal_max_logit_triton(q_BTHE: torch.Tensor, k_BSHE: torch.Tensor, scale: float, q_start: int) -> torch.Tensor:
    """Triton implementation behind `causal_max_logit` (same arguments and result as causal_max_logit_torch);
    float64 runs on the twin."""
    if q_BTHE.dtype == torch.float64 or k_BSHE.dtype == torch.float64 or not scale > 0:
        return causal_max_logit_torch(q_BTHE, k_BSHE, scale, q_start)
    check_device("causal_max_logit", q_BTHE, k_BSHE)
    B, T, H, E = q_BTHE.shape
    S = k_BSHE.shape[1]
    if k_BSHE.shape[0] != B or k_BSHE.shape[2:] != (H, E):
        raise ValueError(f"causal_max_logit: k {tuple(k_BSHE.shape)} does not match q {tuple(q_BTHE.shape)} "
                         f"(expected [B={B}, S, H={H}, E={E}])")
    dtype = torch.promote_types(q_BTHE.dtype, k_BSHE.dtype)  # tl.dot takes one dtype for both operands
    q = q_BTHE.to(dtype)
    k = k_BSHE.to(dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    n_blocks = triton.cdiv(T, BLOCK_M)
    if B * H * n_blocks == 0:
        return torch.full((H,), float("-inf"), device=q.device, dtype=torch.float32)
    ws = torch.empty(B * H, n_blocks, device=q.device, dtype=torch.float32)
    _max_logit_kernel[(B * H, n_blocks)](q, k, ws, T, S, int(q_start), q.stride(0), q.stride(1), q.stride(2),
                                         k.stride(0), k.stride(1), k.stride(2), n_blocks, H=H, E=E,
                                         BE=max(16, triton.next_power_of_2(E)), BM=BLOCK_M, BN=BLOCK_N,
                                         PREC="ieee" if dtype == torch.float32 else "tf32", num_warps=4)
    return ws.view(B, H, n_blocks).amax(dim=(0, 2)) * scale
