"""Reference KDA in plain PyTorch: the token recurrence and the chunkwise equations, one chunk at a time.

Legend: B batch, T tokens, H query/key heads, HV value heads (GVA: value head h reads q/k head h // (HV/H)),
K key dim, V value dim, BT chunk size, S state [K, V] per value head.

Recurrence (kda.md section 1, Kimi Linear arXiv 2510.26692), delta form:

    S' = Diag(exp(g_t)) S_{t-1};   S_t = S' + beta_t k_t (v_t - S'^T k_t)^T;   o_t = S_t^T (scale * q_t)

Chunkwise form (kda.md section 3.1), Gamma = inclusive cumsum of g local to the chunk, S entering the chunk:

    L[i,j]   = beta_i sum_d k_i[d] k_j[d] exp(Gamma_i[d] - Gamma_j[d])   j < i
    Aqk[i,j] =        sum_d q_i[d] k_j[d] exp(Gamma_i[d] - Gamma_j[d])   j <= i
    M = (I + L)^-1;  w = M diag(beta) (k * exp(Gamma));  u = M diag(beta) v;  v_new = u - w S
    o = (q * exp(Gamma)) S + Aqk v_new;  S_next = Diag(exp(Gamma_last)) S + (k * exp(Gamma_last - Gamma))^T v_new

These functions do not normalize q/k or apply gates (see gate.py). They compute in fp32 (float64 when given
float64); outputs are in v's dtype, the final state in the compute dtype. They are the slow, obviously-correct twins
that `chunk_kda` and `fused_recurrent_kda` are tested against.
"""

from __future__ import annotations

import torch

from .gate import compute_dtype


def _expand_heads(q: torch.Tensor, k: torch.Tensor, HV: int):
    """Repeat q/k heads [B, T, H, K] -> [B, T, HV, K] so value head h reads q/k head h // (HV // H) (GVA)."""
    H = q.shape[2]
    if HV % H != 0:
        raise ValueError(f"value heads HV={HV} must be a multiple of q/k heads H={H} (GVA)")
    G = HV // H
    if G == 1:
        return q, k
    return q.repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2)


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
):
    """Token-by-token KDA recurrence (delta form).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] log decay; beta: [B, T, HV] in (0, 1);
    initial_state: [B, HV, K, V] or None (zeros). scale None -> K^-1/2.
    Returns (o [B, T, HV, V] in v.dtype, final state [B, HV, K, V] in the compute dtype or None).
    """
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt, out_dtype = compute_dtype(q), v.dtype
    scale = K**-0.5 if scale is None else scale
    q, k = _expand_heads(q.to(dt), k.to(dt), HV)
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)
    q = q * scale
    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(dt)  # [B, HV, K, V]
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)  # decay first
        k_t = k[:, t]  # [B, HV, K]
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)  # v_t - S'^T k_t
        S = S + torch.einsum("bhk,bhv->bhkv", k_t * beta[:, t].unsqueeze(-1), err)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if T > 0 else v.new_zeros(B, 0, HV, V, dtype=dt)
    return o.to(out_dtype), (S if output_final_state else None)


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., n, n] by row-wise forward substitution.

    Row i of X = (I + L)^-1 satisfies X_i = e_i - sum_{j<i} L[i, j] X_j (rows built as a list: autograd-friendly).
    """
    n = L.shape[-1]
    eye = torch.eye(n, dtype=L.dtype, device=L.device)
    rows: list[torch.Tensor] = []
    for i in range(n):
        row = eye[i].expand(L.shape[:-2] + (n,))
        if i > 0:
            prev = torch.stack(rows, dim=-2)  # [..., i, n]
            row = row - (L[..., i, :i].unsqueeze(-2) @ prev).squeeze(-2)
        rows.append(row)
    return torch.stack(rows, dim=-2)


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
):
    """Chunkwise KDA (kda.md section 3.1) one chunk at a time with exact pairwise exponents; needs T % chunk_size == 0.

    Same arguments and returns as `naive_recurrent_kda`. The debugging twin of `chunk_kda`: every intermediate
    (L, Aqk, M, w, u, v_new) is computed literally from the equations.
    """
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    if T % BT != 0:
        raise ValueError(f"naive_chunk_kda needs T % chunk_size == 0, got T={T}, chunk_size={BT}; use chunk_kda")
    dt, out_dtype = compute_dtype(q), v.dtype
    scale = K**-0.5 if scale is None else scale
    q, k = _expand_heads(q.to(dt), k.to(dt), HV)
    # -> [B, HV, T, D] so the last two dims are (token, channel)
    q, k, v, g = (x.to(dt).transpose(1, 2) for x in (q * scale, k, v, g))
    beta = beta.to(dt).transpose(1, 2)  # [B, HV, T]
    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(dt)
    causal = torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril()  # j <= i
    strict = causal.tril(-1)  # j < i
    outs = []
    for c in range(T // BT):
        sl = slice(c * BT, (c + 1) * BT)
        qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]
        Gam = g[:, :, sl].cumsum(-2)  # [B, HV, BT, K] chunk-local inclusive cumsum
        diff = Gam.unsqueeze(-2) - Gam.unsqueeze(-3)  # [B, HV, BT(i), BT(j), K] = Gamma_i - Gamma_j
        E = diff.masked_fill(~causal.unsqueeze(-1), float("-inf")).exp()  # exact, 0 above the diagonal
        Aqk = torch.einsum("bhid,bhjd,bhijd->bhij", qc, kc, E)
        L = bc.unsqueeze(-1) * torch.einsum("bhid,bhjd,bhijd->bhij", kc, kc, E) * strict
        M = _unit_lower_inverse(L)  # [B, HV, BT, BT]
        w = M @ (bc.unsqueeze(-1) * kc * Gam.exp())  # [B, HV, BT, K]
        u = M @ (bc.unsqueeze(-1) * vc)  # [B, HV, BT, V]
        v_new = u - w @ S
        outs.append((qc * Gam.exp()) @ S + Aqk @ v_new)
        last = Gam[:, :, -1:]  # [B, HV, 1, K]
        S = last.exp().transpose(-1, -2) * S + (kc * (last - Gam).exp()).transpose(-1, -2) @ v_new
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(B, HV, 0, V)
    return o.transpose(1, 2).to(out_dtype), (S if output_final_state else None)
