"""The KDA gate (kda.md section 2) as one Triton pass each way: `kda_gate_triton`, the in-kernel gate of `chunk_kda`
on the "triton" backend, in place of 3-4 PyTorch ops forward and about twice as many backward over [B, T, HV, K].
Twins: gate.naive_kda_gate and gate.naive_kda_lowerbound_gate (the tests compare against them in float64).

    softplus gate:    g = -a softplus(x)        x = z + dt_bias[h, :],  a = exp(A_log[h])
    lower-bound gate: g = lb sigmoid(a x)       (a = 1 without A_log)
Backward, per element, s = sigmoid(a x) or sigmoid(x):
    softplus:    dx = -a sigmoid(x) dg,      dA_log gets g dg       (dg / dA_log = -a softplus(x) = g)
    lower-bound: dx = lb a s (1 - s) dg,     dA_log gets x dx       (dg / dA_log = lb s (1 - s) a x)
dz = dx and d(dt_bias) = sum of dx over tokens. One program per (block of BT tokens, value head) writes dz and its
partial sums of dA_log and d(dt_bias); PyTorch adds the partials (deterministic: no atomics).
softplus(x) = x above 20, log(1 + e^x) below, as torch's default threshold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gate import check_gate_args
from .common import _f32

BT_GATE = 64  # tokens per program


@triton.jit
def _gate_tile(z, A_log, dt_bias, T_all, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
               HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """This program's tile: (offsets p [BT, BK], mask m, column mask m_k, x = z + dt_bias fp32, a = exp(A_log[h]) or 1,
    the block index)."""
    i_b, i_hv = tl.program_id(0), tl.program_id(1)
    o_t = i_b * BT + tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m = (o_t < T_all)[:, None] & m_k[None, :]
    p = (o_t[:, None].to(tl.int64) * HV + i_hv) * K + o_k[None, :]
    x = tl.load(z + p, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
    a = tl.full([], 1.0, tl.float32)
    if HAS_A:
        a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    return p, m, m_k, x, a, i_b


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _gate_value(x, a, lower_bound, LOWER: tl.constexpr):
    """g from x = z + dt_bias and a = exp(A_log) (1 without A_log): lb sigmoid(a x), or -a softplus(x). Also the
    per-token gate of the recurrent kernel (recurrent.py)."""
    if LOWER:
        return lower_bound * tl.sigmoid(a * x)
    else:
        return -a * _softplus(x)


@triton.jit
def _gate_fwd_kernel(z, A_log, dt_bias, g, lower_bound, T_all, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                     BT: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, LOWER: tl.constexpr):
    lower_bound = _f32(lower_bound)  # fp64 when inductor launches us
    p, m, _, x, a, _ = _gate_tile(z, A_log, dt_bias, T_all, HV, K, BK, BT, HAS_A, HAS_BIAS)
    tl.store(g + p, _gate_value(x, a, lower_bound, LOWER), mask=m)


@triton.jit
def _gate_bwd_kernel(z, A_log, dt_bias, dg, dz, dA_part, db_part, lower_bound, T_all, HV: tl.constexpr,
                     K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr,
                     LOWER: tl.constexpr):
    lower_bound = _f32(lower_bound)  # fp64 when inductor launches us
    p, m, m_k, x, a, i_b = _gate_tile(z, A_log, dt_bias, T_all, HV, K, BK, BT, HAS_A, HAS_BIAS)
    i_hv = tl.program_id(1)
    b_dg = tl.load(dg + p, mask=m, other=0.0).to(tl.float32)
    if LOWER:
        s = tl.sigmoid(a * x)
        dx = lower_bound * a * s * (1.0 - s) * b_dg
        dA = x * dx
    else:
        dx = -a * tl.sigmoid(x) * b_dg
        dA = -a * _softplus(x) * b_dg  # g dg
    dx = tl.where(m, dx, 0.0)
    tl.store(dz + p, dx.to(dz.dtype.element_ty), mask=m)
    if HAS_A:
        tl.store(dA_part + i_b * HV + i_hv, tl.sum(tl.sum(tl.where(m, dA, 0.0), axis=1), axis=0))
    if HAS_BIAS:
        tl.store(db_part + (i_b * HV + i_hv) * K + tl.arange(0, BK), tl.sum(dx, axis=0), mask=m_k)


def _launch(z: torch.Tensor):
    HV, K = z.shape[-2:]
    T_all = z.numel() // (HV * K) if HV * K else 0
    return T_all, HV, K, max(16, triton.next_power_of_2(K)), triton.cdiv(T_all, BT_GATE)


class _KDAGateTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, A_log, dt_bias, lower_bound):
        z = z.contiguous()
        T_all, HV, K, BK, nb = _launch(z)
        g = torch.empty(z.shape, dtype=torch.float32, device=z.device)
        flags = {"HAS_A": A_log is not None, "HAS_BIAS": dt_bias is not None, "LOWER": lower_bound is not None}
        if nb and HV:
            _gate_fwd_kernel[(nb, HV)](z, A_log if A_log is not None else g, dt_bias if dt_bias is not None else g, g,
                                       float(lower_bound or 0.0), T_all, HV=HV, K=K, BK=BK, BT=BT_GATE, **flags)
        ctx.save_for_backward(z, A_log, dt_bias)
        ctx.lower_bound, ctx.flags = lower_bound, flags
        return g

    @staticmethod
    def backward(ctx, dg):
        z, A_log, dt_bias = ctx.saved_tensors
        T_all, HV, K, BK, nb = _launch(z)
        dz = torch.empty_like(z)
        dA_part = torch.zeros(max(nb, 1), HV, dtype=torch.float32, device=z.device)
        db_part = torch.zeros(max(nb, 1), HV, K, dtype=torch.float32, device=z.device)
        if nb and HV:
            _gate_bwd_kernel[(nb, HV)](z, A_log if A_log is not None else dz, dt_bias if dt_bias is not None else dz,
                                       dg.contiguous(), dz, dA_part, db_part, float(ctx.lower_bound or 0.0), T_all,
                                       HV=HV, K=K, BK=BK, BT=BT_GATE, **ctx.flags)
        dA = dA_part.sum(0).to(A_log.dtype) if A_log is not None else None
        db = db_part.sum(0).reshape(-1).to(dt_bias.dtype) if dt_bias is not None else None
        return dz, dA, db, None


def kda_gate_triton(z: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                    lower_bound: float | None) -> torch.Tensor:
    """g [B, T, HV, K] fp32 from the raw gate projection z [B, T, HV, K]: the lower-bound gate when `lower_bound`
    is set (A_log [HV] optional), else the softplus gate (A_log required); dt_bias [HV*K] or None. Autograd flows to
    z, A_log and dt_bias. Same definitions and checks as gate.naive_kda_lowerbound_gate / naive_kda_gate."""
    check_gate_args(A_log, lower_bound)
    return _KDAGateTriton.apply(z, A_log, dt_bias, lower_bound)
