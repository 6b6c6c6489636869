"""Chunkwise KDA in PyTorch (`chunk_kda_torch`, `chunk_kda` on the "torch" backend): the training and prefill path,
with a hand-written backward.

Legend: B batch, T tokens, N sequences (B, or len(cu_seqlens) - 1 with varlen), H q/k heads, HV value heads,
K key dim, V value dim, BT = chunk_size (16/32/64), BC = 16 block, NT blocks, Z = N * HV, Tp padded length.

Equations: kda.md section 3.1 (the chunkwise form is exact for any block length). Pipeline:
1. in-kernel steps (l2norm, gate, beta sigmoid) in fp32 via autograd (gate.py); q scaled; q/k heads repeated (GVA);
2. every sequence is zero-padded to a multiple of BC (varlen: gathered into one padded row per sequence); a padded
   token has g = k = beta = 0, an identity step, so states and earlier outputs are unaffected;
3. per BC-token block, for all blocks at once: Aqk (j <= i) and L (j < i) from exp(Gamma_i - Gamma_j), Gamma the
   block-local cumsum of g, never split over a span where it could overflow (kda.md 3.3):
     - default: exact pairwise exponents per element [.., BC, BC, K] (any g, including -1000);
     - `safe_gate` (every g >= lb >= -5): one matmul with the fixed anchor C = Gamma_0 - (BC - 1) * s / 2,
       s = -lb (2 if unset): query factor exp(Gamma_i - C) <= e^(7.5 s), key factor exp(C - Gamma_j) <= e^(75 - 7.5 s),
       both finite in fp32. C depends only on the block's first token, so appending tokens cannot move it;
4. M = (I + L)^-1 by block doubling (unit_lower_inverse), then [w | u] = M diag(beta) [k * exp(Gamma) | v];
5. the only sequential part: the state scan over blocks (fp32 states), then o = (q * exp(Gamma)) h + Aqk v_new.

Why 16-token blocks whatever `chunk_size` is: on CPU the intra-block work grows with the block length while the scan
is cheap, and a 16-token block with the fixed anchor needs no sub-chunk bookkeeping. `chunk_size` keeps its meaning
for callers: `h` holds the state entering every chunk of `chunk_size` tokens (kda.md section 8 alignment).
The backward (reverse state scan, then batched gradients of M, Aqk, L and the decays) is derived by hand from the
forward; tests check it against autograd through `naive_recurrent_kda` in float64.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .checks import SAFE_GATE_FLOOR, SUB_CHUNK
from .gate import prepare_kda_inputs
from .naive import _expand_heads

# --------------------------------------------------------------------------------------------------------------------
# padding / varlen packing


@dataclass
class SeqLayout:
    """How [B, T] tokens map onto N zero-padded rows of length Tp (a multiple of `multiple`)."""

    N: int
    Tp: int
    lengths: list[int]
    gather: torch.Tensor | None  # [N, Tp] index into T_total + 1 rows (last = zero row); None without varlen
    scatter: torch.Tensor | None  # [T_total] row-major position of each token in [N, Tp]


def make_layout(B: int, T: int, cu_seqlens: torch.Tensor | None, multiple: int, device,
                cu_host: list[int] | None = None) -> SeqLayout:
    """Layout for fixed-length [B, T] (pad at the end) or varlen cu_seqlens (one padded row per sequence);
    `cu_host`: the same offsets as host ints, read instead of cu_seqlens when given."""
    if cu_seqlens is None:
        return SeqLayout(B, math.ceil(T / multiple) * multiple, [T] * B, None, None)
    cu = cu_host if cu_host is not None else cu_seqlens.tolist()
    lengths = [b - a for a, b in itertools.pairwise(cu)]
    N, Tp = len(lengths), max(math.ceil(n / multiple) * multiple for n in lengths)
    t = torch.arange(Tp, device=device)
    starts = torch.tensor(cu[:-1], device=device).unsqueeze(1)
    lens = torch.tensor(lengths, device=device).unsqueeze(1)
    gather = torch.where(t < lens, starts + t, torch.full_like(t, T))  # [N, Tp]
    scatter = torch.cat([n * Tp + torch.arange(L, device=device) for n, L in enumerate(lengths)])
    return SeqLayout(N, Tp, lengths, gather, scatter)


def to_padded(x: torch.Tensor, lay: SeqLayout) -> torch.Tensor:
    """[B, T, ...] -> [N, Tp, ...], zeros in the padding."""
    if lay.gather is None:
        B, T = x.shape[:2]
        return x if lay.Tp == T else torch.cat([x, x.new_zeros((B, lay.Tp - T) + x.shape[2:])], dim=1)
    flat = torch.cat([x[0], x.new_zeros((1,) + x.shape[2:])])  # [T_total + 1, ...]
    return flat[lay.gather]


def from_padded(y: torch.Tensor, lay: SeqLayout, T: int) -> torch.Tensor:
    """[N, Tp, ...] -> [B, T, ...] (inverse of to_padded on the real tokens)."""
    if lay.gather is None:
        return y[:, :T]
    return y.reshape((lay.N * lay.Tp,) + y.shape[2:])[lay.scatter].unsqueeze(0)


# --------------------------------------------------------------------------------------------------------------------
# the blockwise algorithm (blocks of BC = 16 tokens) with a hand-written backward


def _tri_masks(n: int, device):
    pos = torch.arange(n, device=device)
    causal = pos.unsqueeze(1) >= pos.unsqueeze(0)  # [n, n] j <= i
    return causal, causal.tril(-1)  # (j <= i, j < i)


def unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., n, n] (n a power of 2) by block doubling, no autograd.

    With the inverse X of the diagonal blocks of size b known, each 2b block [[A, 0], [C, D]] has inverse
    [[A^-1, 0], [-D^-1 C A^-1, D^-1]] (the block-inverse merge of kda.md 3.2); log2(n) batched matmul levels.
    """
    n = L.shape[-1]
    M = torch.eye(n, dtype=L.dtype, device=L.device).expand(L.shape).clone()
    b = 1
    while b < n:
        P = n // (2 * b)  # number of 2b x 2b diagonal blocks; view them as [..., P, 2b, 2b] (shares memory with M)
        Lb = torch.diagonal(L.view(*L.shape[:-2], P, 2 * b, P, 2 * b), dim1=-4, dim2=-2).movedim(-1, -3)
        Mb = torch.diagonal(M.view(*M.shape[:-2], P, 2 * b, P, 2 * b), dim1=-4, dim2=-2).movedim(-1, -3)
        Mb[..., b:, :b] = -(Mb[..., b:, b:] @ (Lb[..., b:, :b] @ Mb[..., :b, :b]))
        b *= 2
    return M


def _pairwise_kE(k, Gam, causal):
    """E[i, j, d] = exp(Gamma_i[d] - Gamma_j[d]) for j <= i (else 0), exact for any g; [.., BC, BC, K]."""
    diff = Gam.unsqueeze(-2) - Gam.unsqueeze(-3)
    E = diff.masked_fill_(~causal.unsqueeze(-1), float("-inf")).exp_()
    return E, E * k.unsqueeze(-3)  # (E, k_j * E)


def _intra_fwd(q, k, Gam, shift):
    """Aqk (j <= i) and Akk (j < i, no beta) of every block; q, k, Gam: [NT, Z, BC, K] -> [NT, Z, BC, BC].

    Also returns what the safe-path backward reuses: (rows [q * rf ; k * rf] [.., 2BC, K], k * cf, rf, cf), or ().
    """
    BC = q.shape[-2]
    causal, strict = _tri_masks(BC, q.device)
    if shift is not None:  # fixed anchor C = Gamma_0 - shift: both factors finite when every g >= lb >= -5
        C = Gam[..., :1, :] - shift
        rf, cf = (Gam - C).exp(), (C - Gam).exp()  # row factor <= e^shift, column factor <= e^(75 - shift)
        rows = (torch.stack([q, k], dim=-3) * rf.unsqueeze(-3)).flatten(-3, -2)  # [NT, Z, 2BC, K]
        Kc = k * cf
        A = rows @ Kc.transpose(-1, -2)  # [NT, Z, 2BC, BC]
        Aq, Ak = A[..., :BC, :], A[..., BC:, :]
        saved = (rows, Kc, rf, cf)
    else:
        _, kE = _pairwise_kE(k, Gam, causal)
        d = kE @ torch.stack([q, k], dim=-1)  # [NT, Z, BC(i), BC(j), 2]
        Aq, Ak = d[..., 0], d[..., 1]
        saved = ()
    return Aq.masked_fill(~causal, 0.0), Ak.masked_fill(~strict, 0.0), saved


def _intra_bwd(q, k, Gam, saved, dAq, dAk, dq, dk, dG):
    """Add the gradients of (Aqk, Akk) to dq, dk, dGamma in place; dAq, dAk already masked like the forward."""
    BC = q.shape[-2]
    if saved:
        rows, Kc, rf, cf = saved
        dA = torch.cat([dAq, dAk], dim=-2)  # [.., 2BC, BC]
        drows = dA @ Kc  # [.., 2BC, K]
        dKc = dA.transpose(-1, -2) @ rows  # [.., BC, K]
        # d/dGamma through rf (+) and cf (-); C = Gamma_0 - shift adds dC = -sum_i t_i to row 0
        t = (drows * rows).unflatten(-2, (2, BC)).sum(-3).sub_(dKc * Kc)
        dG += t
        dG[..., 0, :] -= t.sum(-2)
        dQr, dKr = drows[..., :BC, :], drows[..., BC:, :]
        dq.addcmul_(dQr, rf)
        dk.addcmul_(dKr, rf).addcmul_(dKc, cf)
        return
    causal, _ = _tri_masks(BC, q.device)
    E, kE = _pairwise_kE(k, Gam, causal)
    drow = torch.stack([dAq, dAk], dim=-2) @ kE  # [.., i, 2, K]: sum_j dA_ij k_j E_ij
    dq_row, dk_row = drow[..., 0, :], drow[..., 1, :]
    Y = torch.stack([dAq, dAk], dim=-1) @ torch.stack([q, k], dim=-2)  # [.., i, j, K]: dAq_ij q_i + dAk_ij k_i
    dk_col = (Y * E).sum(-3)  # sum_i (..) E_ij
    # dGamma_i = sum_j X_ij - sum_j X_ji with X_ij = (dAq_ij q_i + dAk_ij k_i) k_j E_ij, folded into row/col sums
    dq += dq_row
    dk += dk_row + dk_col
    dG += q * dq_row + k * (dk_row - dk_col)


class _ChunkKDA(torch.autograd.Function):
    """Blockwise KDA core. q (scaled), k, g: [NT, Z, BC, K]; v: [NT, Z, BC, V]; beta: [NT, Z, BC]; h0: [Z, K, V].

    Returns o [NT, Z, BC, V], final state [Z, K, V], hs [NT, Z, K, V] (state entering each block, no gradient).
    The exp factors are saved rather than recomputed: the backward is memory-bound on CPU.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, shift):
        NT, Z, BC, K = q.shape
        V = v.shape[-1]
        Gam = g.cumsum(-2)  # block-local inclusive cumsum
        Aq, Ak, intra = _intra_fwd(q, k, Gam, shift)
        b = beta.unsqueeze(-1)
        M = unit_lower_inverse(b * Ak)  # (I + L)^-1, L = diag(beta) Akk
        eG = Gam.exp()  # <= 1: only underflow
        rhs = torch.empty(NT, Z, BC, K + V, dtype=q.dtype, device=q.device)
        torch.mul(b * eG, k, out=rhs[..., :K])
        torch.mul(b, v, out=rhs[..., K:])
        wu = M @ rhs  # [w | u] = M diag(beta) [k * exp(Gamma) | v]
        w, u = wu[..., :K], wu[..., K:]
        last = Gam[..., -1:, :]
        eL = (last - Gam).exp()  # exp(Gamma_last - Gamma) <= 1
        kg = k * eL
        dec = last.exp().transpose(-1, -2)  # [NT, Z, K, 1]
        hs = torch.empty(NT + 1, Z, K, V, dtype=q.dtype, device=q.device)  # hs[c] = state entering block c
        vn = u.clone()
        hs[0] = h0
        for c in range(NT):  # the only sequential loop: state scan over blocks
            vn[c].baddbmm_(w[c], hs[c], alpha=-1)  # v_new = u - w S
            torch.mul(dec[c], hs[c], out=hs[c + 1]).baddbmm_(kg[c].transpose(-1, -2), vn[c])  # Diag(dec) S + kg^T v_new
        S, hs = hs[NT].clone(), hs[:NT]
        qg = q * eG
        o = torch.baddbmm((Aq @ vn).reshape(NT * Z, BC, V), qg.reshape(NT * Z, BC, K), hs.view(NT * Z, K, V))
        ctx.save_for_backward(q, k, v, beta, Gam, Aq, Ak, M, wu, hs, vn, eG, eL, kg, qg, *intra)
        ctx.mark_non_differentiable(hs)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for hs (and for o / S when unused)
        return o.view(NT, Z, BC, V), S, hs

    @staticmethod
    def backward(ctx, do, dS, _dhs):
        q, k, v, beta, Gam, Aq, Ak, M, wu, hs, vn, eG, eL, kg, qg, *intra = ctx.saved_tensors
        NT, _, BC, K = q.shape
        causal, strict = _tri_masks(BC, q.device)
        w = wu[..., :K]
        dec = Gam[..., -1:, :].exp().transpose(-1, -2)  # [NT, Z, K, 1]
        do = torch.zeros_like(vn) if do is None else do.contiguous()
        dS = torch.zeros_like(hs[0]) if dS is None else dS.contiguous()
        # reverse scan: dv_new = Aq^T do + kg dS';  dS = qg^T do + Diag(decay) dS' - w^T dv_new
        dvn = Aq.transpose(-1, -2) @ do  # [NT, Z, BC, V]
        dh = qg.transpose(-1, -2) @ do  # [NT, Z, K, V]
        dSn = torch.empty((NT + 1,) + hs.shape[1:], dtype=q.dtype, device=q.device)  # dSn[c + 1]: grad leaving c
        dSn[NT] = dS
        for c in range(NT - 1, -1, -1):
            dvn[c].baddbmm_(kg[c], dSn[c + 1])
            torch.addcmul(dh[c], dec[c], dSn[c + 1], out=dSn[c]).baddbmm_(w[c].transpose(-1, -2), dvn[c], alpha=-1)
        dS, dSn = dSn[0].clone(), dSn[1:]
        dqg = do @ hs.transpose(-1, -2)  # [NT, Z, BC, K]
        dAq = (do @ vn.transpose(-1, -2)).masked_fill_(~causal, 0.0)
        dkg = vn @ dSn.transpose(-1, -2)  # [NT, Z, BC, K]
        # [w | u] = M [kb | vb]:  d[kb | vb] = M^T [dw | du],  dL = -M^T dM M^T = -(dkb w^T + dvb u^T) (strict lower)
        dwu = torch.cat([-(dvn @ hs.transpose(-1, -2)), dvn], dim=-1)
        dkbvb = M.transpose(-1, -2) @ dwu
        dL = (dkbvb @ wu.transpose(-1, -2)).neg_().masked_fill_(~strict, 0.0)
        dkb, dvb = dkbvb[..., :K], dkbvb[..., K:]
        b = beta.unsqueeze(-1)
        kbg = dkb * eG  # d(beta k exp(Gamma)) / beta, w.r.t. k
        kbgk = kbg * k
        dbeta = (dL * Ak).sum(-1) + kbgk.sum(-1) + (dvb * v).sum(-1)
        dv = b * dvb
        dq = dqg * eG
        dk = torch.addcmul(b * kbg, dkg, eL)
        dkg_kg = dkg * kg
        dG = torch.addcmul(b * kbgk, dqg, qg).sub_(dkg_kg)
        dG[..., -1, :] += dkg_kg.sum(-2) + (dSn * hs).sum(-1) * dec.squeeze(-1)  # through last = Gamma_{BC-1}
        _intra_bwd(q, k, Gam, intra, dAq, b * dL, dq, dk, dG)
        dg = dG.sum(-2, keepdim=True) - dG.cumsum(-2) + dG  # Gamma = cumsum(g): reverse cumsum
        return dq, dk, dv, dg, dbeta, dS, None


def chunk_core(q, k, v, g, beta, h0, safe_shift: float | None):
    """Blockwise KDA on padded inputs (Tp % 16 == 0), all in the compute dtype.

    q (scaled), k, g: [N, Tp, HV, K] (heads repeated for GVA); v: [N, Tp, HV, V]; beta: [N, Tp, HV];
    h0: [N, HV, K, V] or None. Returns o [N, Tp, HV, V], final state [N, HV, K, V], hs [N, Tp/16, HV, K, V].
    """
    N, Tp, HV, K = q.shape
    V = v.shape[-1]
    NT, BC = Tp // SUB_CHUNK, SUB_CHUNK
    S0 = q.new_zeros(N, HV, K, V) if h0 is None else h0
    if NT == 0:
        return q.new_zeros(N, 0, HV, V), S0.clone(), q.new_zeros(N, 0, HV, K, V)

    def blocks(x):  # [N, Tp, HV, D] -> [NT, N * HV, BC, D]: block-major so the scan reads contiguous slices
        y = x.reshape(N, NT, BC, HV, -1).permute(1, 0, 3, 2, 4)
        return y.reshape(NT, N * HV, BC, x.shape[-1]).contiguous()

    o, S, hs = _ChunkKDA.apply(blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta.unsqueeze(-1)).squeeze(-1),
                               S0.reshape(N * HV, K, V), safe_shift)
    o = o.view(NT, N, HV, BC, V).permute(1, 0, 3, 2, 4).reshape(N, Tp, HV, V)
    return o, S.view(N, HV, K, V), hs.view(NT, N, HV, K, V).transpose(0, 1)


def chunk_kda_torch(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, safe_gate, lower_bound, chunk_size,
                    cu_seqlens, return_intermediate_states, state_v_first, cu_seqlens_cpu=None):
    """PyTorch implementation behind `chunk_kda` (arguments already validated; see chunk_kda; cu_seqlens_cpu is a
    list of ints or None here)."""
    B, T, _, K = q.shape
    HV = v.shape[2]
    out_dtype = v.dtype
    # The reference path computes in fp32 at least (bf16/fp16 inputs are upcast, float64 stays float64) and
    # ignores any surrounding autocast, so mixed-precision training gets fp32 states; the Triton path stores
    # intermediates in the input dtype instead (kda.md 3.3).
    dt = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    q, k, g, beta = prepare_kda_inputs(
        q, k, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    safe_shift = None
    if safe_gate:
        floor = SAFE_GATE_FLOOR if lower_bound is None else lower_bound
        if not use_gate_in_kernel and g.numel() and g.min().item() < floor:
            raise ValueError(f"chunk_kda: safe_gate=True needs every g >= {floor} (lower_bound), got min(g)="
                             f"{g.min().item():.4g}; clamp g to [lower_bound, 0] or pass safe_gate=False")
        s = -lower_bound if lower_bound is not None else 2.0
        safe_shift = (SUB_CHUNK - 1) * s / 2  # C = Gamma_0 - (BC - 1) s / 2 (kda.md 3.3)
    scale = K**-0.5 if scale is None else scale
    q, k = _expand_heads(q * scale, k, HV)
    lay = make_layout(B, T, cu_seqlens, SUB_CHUNK, q.device, cu_seqlens_cpu)
    q, k, v, g, beta = (to_padded(x, lay) for x in (q, k, v.to(dt), g, beta))
    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(dt)
        h0 = h0.transpose(-1, -2) if state_v_first else h0
    with torch.autocast(device_type=q.device.type, enabled=False):
        o, S, hs = chunk_core(q, k, v, g, beta, h0, safe_shift)
    o = from_padded(o, lay, T).to(out_dtype)
    final = None
    if output_final_state:
        final = S.transpose(-1, -2).contiguous() if state_v_first else S
    if not return_intermediate_states:
        return o, final
    every = chunk_size // SUB_CHUNK  # states entering each chunk = every `every`-th block state
    if lay.gather is None:
        h = hs[:, ::every]  # [B, ceil(T / chunk_size), HV, K, V]
    else:  # keep only real chunks, sequence after sequence: [1, total chunks, ...]
        h = torch.cat([hs[n, : math.ceil(L / SUB_CHUNK) : every] for n, L in enumerate(lay.lengths)]).unsqueeze(0)
    h = h.transpose(-1, -2).contiguous() if state_v_first else h
    return o, final, h

