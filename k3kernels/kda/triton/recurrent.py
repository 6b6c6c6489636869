"""Recurrent KDA as a Triton kernel (`fused_recurrent_kda` on the "triton" backend): decode and short appends.

Legend: B batch, T tokens, N sequences, H q/k heads, HV value heads, K key dim, V value dim, P pool slots,
BK = next_pow2(K), BV = value block (32), S_max draft positions per sequence.

One program per (V block, sequence, value head) holds its [BK, BV] slice of the fp32 state in registers and loops
over the sequence's tokens, each step the delta form of kda.md section 1 (Kimi Linear, arXiv 2510.26692):

    S' = Diag(exp(g_t)) S;   S = S' + beta_t k_t (v_t - S'^T k_t)^T;   o_t = S^T (scale * q_t)

The optional in-kernel steps (q/k L2 norm, the softplus or lower-bound gate, the beta sigmoid; kda.md section 2)
are applied per token inside the loop. Every load over K or V is masked, so any K <= 256 (60, 100, ...) works.

State pool semantics are exactly those of the PyTorch twin (fused_recurrent.py): `ssm_state_indices` [N] reads
and writes pool[idx[n]] in place (negative index: start from zeros, write nothing); with `num_accepted_tokens` and
[N, S_max] indices, sequence n starts from pool[idx[n, num_accepted_tokens[n] - 1]] and the state after each of its
tokens t goes to pool[idx[n, t]]. Each program touches only its own (slot, head, V block), so slots that are not
named are never written (bit-identical). The state is addressed through strides, so K-first and V-first
(`state_v_first`) layouts share one kernel.

float64 inputs (the reference precision) are computed by the PyTorch twin: the kernel accumulates in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...dispatch import check_device, inputs_trusted
from ..fused_recurrent import _check_pool, fused_recurrent_kda_torch
from .common import _f32
from .gate import _gate_value

BV_DEFAULT = 32  # kda.md section 5; at B = 1 the twice as many programs of BV 32 keep the latency down
BV_WIDE = 64  # 0.87 of copy bandwidth against 0.80 at BV 32 at B = 256 (0.72 against 0.69 at B = 64; H200, H = 16)
WIDE_FROM = 256  # sequences x value heads from which BV_WIDE is used (B >= 16 at 16 heads)
# Launch settings, module-level so that benchmarks/kda.py --decode-sweep can try others on a GPU. Slower at B = 256 on
# an H200, so not used: a register cap, streaming cache hints on the pool, one program per (head, sequence) looping
# over the V blocks, a persistent decode step.
LAUNCH: dict[str, int | None] = {
    "BV": None,  # None: BV_DEFAULT below WIDE_FROM sequence-heads, BV_WIDE from there
    "num_warps": None,  # None: 4 when the [BK, BV] state tile has >= 4096 elements, else 2
}


def v_block(N: int, HV: int, V: int) -> int:
    """The V block of a launch over N sequences and HV value heads (LAUNCH["BV"] when set)."""
    bv = LAUNCH["BV"] or (BV_WIDE if N * HV >= WIDE_FROM else BV_DEFAULT)
    return min(bv, triton.next_power_of_2(V))


@triton.jit
def _slot_mask(m, slot):
    """m & (slot >= 0) for a block mask m and a scalar slot index, the comparison made at m's shape. Triton's
    interpreter tags a scalar comparison with its operands' dtype (int64 here) and so widens `slot >= 0` to an int64
    block, which makes `m & (slot >= 0)` an int32 mask; Triton 3.9's interpreter refuses a mask that is not bool
    ("mask has unsupported dtype"; 3.6 to 3.8 took it). Compared at the block shape it is bool in every version, and
    compiled it is the same code (the PTX of every variant of test_kda_recurrent_compile.py unchanged)."""
    return m & (tl.broadcast_to(slot, m.shape) >= 0)


@triton.jit
def _recurrent_kda_kernel(
    q, k, v, g, beta, o, A_log, dt_bias, h0, ht, cu_seqlens, slots, per_token,
    scale, lower_bound, T,
    s0_n, s0_h, s0_k, s0_v,  # strides of h0 (initial state or pool): row, head, key, value
    st_n, st_h, st_k, st_v,  # strides of ht (final state)
    pt_n,  # row stride of per_token slots [N, S_max]
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, GATE: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
    POOL: tl.constexpr, PER_TOKEN: tl.constexpr, VARLEN: tl.constexpr,
):
    i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # float arguments arrive as fp64 scalars when inductor launches this kernel (torch.compile of the decode step):
    # cast them, else the state would turn fp64 and the loop below would not compile
    scale, lower_bound = _f32(scale), _f32(lower_bound)
    i_h = i_hv // (HV // H)  # GVA: value head i_hv reads q/k head i_hv // (HV / H)
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = (tl.load(cu_seqlens + i_n + 1) - tl.load(cu_seqlens + i_n)).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T
        seq_len = T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]

    # initial state: row i_n of h0, or pool slot `slot` (negative: zeros, nothing read)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
    slot = i_n.to(tl.int64)
    if HAS_H0:
        if POOL:
            slot = tl.load(slots + i_n).to(tl.int64)
        p_h0 = h0 + tl.maximum(slot, 0) * s0_n + i_hv * s0_h + o_k[:, None] * s0_k + o_v[None, :] * s0_v
        b_h = tl.load(p_h0, mask=_slot_mask(m_kv, slot), other=0.0).to(tl.float32)

    if GATE:
        b_A = tl.full([], 1.0, tl.float32)  # the lower-bound gate without A_log
        if HAS_A_LOG:
            b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            b_bias = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)

    t = 0
    while t < seq_len:  # a while loop: Triton's interpreter cannot range() over a runtime scalar under numpy >= 2.4
        tok = bos + t
        b_q = tl.load(q + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
        b_k = tl.load(k + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
        b_vt = tl.load(v + (tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
        b_g = tl.load(g + (tok * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
        b_b = tl.load(beta + tok * HV + i_hv).to(tl.float32)
        if L2NORM:  # x / sqrt(sum x^2 + 1e-6), eps inside the sqrt (kda.md section 2)
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        if GATE:
            if HAS_DT_BIAS:
                b_g = b_g + b_bias
            # lb * sigmoid(exp(A_log) * (z + dt_bias)), or -exp(A_log) * softplus(z + dt_bias)
            b_g = _gate_value(b_g, b_A, lower_bound, LOWER_BOUND_GATE)
            b_g = tl.where(m_k, b_g, 0.0)
        if BETA_SIGMOID:
            b_b = tl.sigmoid(b_b)
        # both products from the state before the step: with the decay d = e^g, S'^T k = S^T (d k), and
        # o = (S' + beta k err^T)^T (scale q) = S^T (d scale q) + (beta scale k.q) err; the update
        # S' + beta k err^T = d S + beta k err^T then one multiply-add per element, off the output's path. Decaying,
        # updating, then reducing the updated tile for o (the step as written) takes 146.0 us against 139.5 at
        # B = 256, 44.0 against 41.3 at B = 64 (H200, one step in a CUDA graph, H = 16, K = V = 128)
        b_d = tl.exp(b_g)
        b_err = b_vt - tl.sum(b_h * (b_d * b_k)[:, None], axis=0)  # v_t - S'^T k_t   [BV]
        b_o = tl.sum(b_h * (b_d * scale * b_q)[:, None], axis=0) + tl.sum(b_b * scale * b_k * b_q) * b_err  # [BV]
        b_h = b_h * b_d[:, None] + (b_b * b_k)[:, None] * b_err[None, :]
        tl.store(o + (tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if PER_TOKEN:  # speculative decoding: the state after token t goes to its own slot
            s_t = tl.load(per_token + i_n * pt_n + t).to(tl.int64)
            p_w = h0 + tl.maximum(s_t, 0) * s0_n + i_hv * s0_h + o_k[:, None] * s0_k + o_v[None, :] * s0_v
            tl.store(p_w, b_h.to(h0.dtype.element_ty), mask=_slot_mask(m_kv, s_t))
        t += 1

    if POOL and not PER_TOKEN:  # write the final state back to the sequence's own slot, in place
        p_h0 = h0 + tl.maximum(slot, 0) * s0_n + i_hv * s0_h + o_k[:, None] * s0_k + o_v[None, :] * s0_v
        tl.store(p_h0, b_h.to(h0.dtype.element_ty), mask=_slot_mask(m_kv, slot))
    if STORE_HT:
        p_ht = ht + i_n * st_n + i_hv * st_h + o_k[:, None] * st_k + o_v[None, :] * st_v
        tl.store(p_ht, b_h.to(ht.dtype.element_ty), mask=m_kv)


def fused_recurrent_kda_triton(q, k, v, g, beta, *, A_log, dt_bias, scale, initial_state, output_final_state,
                               use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound,
                               cu_seqlens, state_v_first, ssm_state_indices, num_accepted_tokens):
    """Triton implementation behind `fused_recurrent_kda` (arguments validated by the public function).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV]; initial_state [N, HV, K, V] fp32
    (or the pool [P, HV, K, V], V-first with `state_v_first`). Returns (o [B, T, HV, V] in v.dtype,
    final_state [N, HV, K, V] fp32 or None); the pool is updated in place. Semantics: fused_recurrent.py.
    """
    kwargs = {"A_log": A_log, "dt_bias": dt_bias, "scale": scale, "initial_state": initial_state,
              "output_final_state": output_final_state, "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
              "use_gate_in_kernel": use_gate_in_kernel, "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
              "lower_bound": lower_bound, "cu_seqlens": cu_seqlens, "state_v_first": state_v_first,
              "ssm_state_indices": ssm_state_indices, "num_accepted_tokens": num_accepted_tokens}
    if q.dtype == torch.float64:  # the reference precision stays on the PyTorch twin (the kernel accumulates in fp32)
        return fused_recurrent_kda_torch(q, k, v, g, beta, **kwargs)
    check_device("fused_recurrent_kda", q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))

    pooled = ssm_state_indices is not None
    slots = per_token = None
    if pooled:
        # CUDA-graph capture or a trusted caller (dispatch.trusted_inputs): the value checks need host reads, which
        # a graph cannot capture and which stall the GPU queue; the caller checked the values on the host
        skip = q.is_cuda and (torch.cuda.is_current_stream_capturing() or inputs_trusted())
        if skip:
            if num_accepted_tokens is None:
                slots = ssm_state_indices
            else:
                per_token = ssm_state_indices
                slots = per_token.gather(1, (num_accepted_tokens.long() - 1).unsqueeze(1)).squeeze(1)
        else:
            max_len = T if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if N else 0
            slots, per_token = _check_pool(initial_state, ssm_state_indices, num_accepted_tokens, N, HV, K, V,
                                           state_v_first, max_len)
        slots = slots.to(torch.int32).contiguous()
        per_token = per_token.to(torch.int32).contiguous() if per_token is not None else None

    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    ht = None
    if output_final_state:
        ht = torch.empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32, device=q.device)
    h0 = initial_state
    dummy = o  # placeholder pointer for absent tensors (never dereferenced: the constexpr flags switch them off)

    def strides(x):  # (row, head, key, value) strides of a [*, HV, K, V] or [*, HV, V, K] state
        if x is None:
            return 0, 0, 0, 0
        return (x.stride(0), x.stride(1), x.stride(3), x.stride(2)) if state_v_first else tuple(x.stride())

    BK = triton.next_power_of_2(K)
    BV = v_block(N, HV, V)
    # programs in launch order walk each sequence's state [HV, K, V] front to back (V blocks, then heads, then
    # sequences), the order of its bytes in memory; a grid (V blocks, N, HV) jumps a whole state (HV * K * V * 4
    # bytes) between neighbours. fla-core 0.6.0's by-slot decode step walks heads within a sequence too: 157.9 us
    # against this kernel's 145.7 at B = 256 on an H200
    grid = (triton.cdiv(V, BV), HV, N)
    if N and HV:
        _recurrent_kda_kernel[grid](
            q, k, v, g, beta, o,
            A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
            h0 if h0 is not None else dummy, ht if ht is not None else dummy,
            cu_seqlens if cu_seqlens is not None else dummy,
            slots if slots is not None else dummy, per_token if per_token is not None else dummy,
            float(scale), float(lower_bound) if lower_bound is not None else 0.0, T,
            *strides(h0), *strides(ht), per_token.stride(0) if per_token is not None else 0,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
            L2NORM=use_qk_l2norm_in_kernel, GATE=use_gate_in_kernel, LOWER_BOUND_GATE=lower_bound is not None,
            HAS_A_LOG=A_log is not None, HAS_DT_BIAS=dt_bias is not None, BETA_SIGMOID=use_beta_sigmoid_in_kernel,
            HAS_H0=h0 is not None, STORE_HT=ht is not None, POOL=pooled, PER_TOKEN=per_token is not None,
            VARLEN=cu_seqlens is not None,
            num_warps=LAUNCH["num_warps"] or (4 if BK * BV >= 4096 else 2),
        )
    return o, ht
