"""Recurrent KDA in PyTorch (`fused_recurrent_kda`): decode and short appends, optionally on a slotted state pool.

Legend: B batch, T tokens, N sequences, H q/k heads, HV value heads, K key dim, V value dim, P pool slots,
S_max draft positions per sequence (speculative decoding).

One step per token for all sequences and heads at once, in the delta form of kda.md section 1:

    S' = Diag(exp(g_t)) S;   S = S' + beta_t k_t (v_t - S'^T k_t)^T;   o_t = S^T (scale * q_t)

State pool (`ssm_state_indices`, the serving layout of vLLM's recurrent kernels):
- [N] indices: sequence n starts from pool[idx[n]] and its final state is written back to pool[idx[n]] in place.
  A negative index (vLLM's PAD_SLOT_ID = -1) means "no slot": start from zeros, write nothing. Slots not named are
  left bit-identical.
- [N, S_max] indices with `num_accepted_tokens` [N] (speculative decoding, kda.md 5, k3 choice, vLLM's GDN
  convention): sequence n starts from pool[idx[n, num_accepted_tokens[n] - 1]] (the state after the last accepted
  draft token of the previous step) and the state after each of its tokens t is written to pool[idx[n, t]], so a
  rejected draft rolls back by reading an earlier slot, without recompute.
Pool writes are detached (this path is forward-only, kda.md section 5).
"""

from __future__ import annotations

import torch

from ..dispatch import resolve, trusted_inputs
from .checks import check_kda_args, reject_unsupported
from .chunk_torch import from_padded, make_layout, to_padded
from .gate import compute_dtype, prepare_kda_inputs
from .naive import _expand_heads


def _check_pool(pool, idx, num_accepted_tokens, N, HV, K, V, state_v_first, max_len):
    """Validate the state pool arguments; return (pool slot of each sequence's initial state [N], per-token slots)."""
    def need(cond, msg):
        if not cond:
            raise ValueError(f"fused_recurrent_kda: {msg}")

    need(pool is not None, "ssm_state_indices needs initial_state to be the state pool [P, HV, K, V]")
    inner = (HV, V, K) if state_v_first else (HV, K, V)
    need(pool.dim() == 4 and tuple(pool.shape[1:]) == inner,
         f"the state pool (initial_state) must be [P, {', '.join(map(str, inner))}] (state_v_first={state_v_first}), "
         f"got {tuple(pool.shape)}")
    need(isinstance(idx, torch.Tensor) and not idx.is_floating_point(), "ssm_state_indices must be an integer tensor")
    P = pool.shape[0]
    if num_accepted_tokens is None:
        need(tuple(idx.shape) == (N,), f"ssm_state_indices must be [N={N}] (one pool slot per sequence), got "
                                       f"{tuple(idx.shape)}; [N, S_max] is only for num_accepted_tokens")
        slots = idx.long()
        per_token = None
    else:
        need(idx.dim() == 2 and idx.shape[0] == N and idx.shape[1] >= max(max_len, 1),
             f"with num_accepted_tokens, ssm_state_indices must be [N={N}, S_max >= {max_len}] (a slot per token), "
             f"got {tuple(idx.shape)}")
        nat = num_accepted_tokens.long()
        need(tuple(nat.shape) == (N,) and bool(((nat >= 1) & (nat <= idx.shape[1])).all()),
             f"num_accepted_tokens must be [N={N}] with values in [1, {idx.shape[1]}], got {nat.tolist()}")
        per_token = idx.long()
        slots = per_token.gather(1, (nat - 1).unsqueeze(1)).squeeze(1)
    need(bool((idx < P).all()), f"ssm_state_indices must be < pool size P={P}, got max {int(idx.max())}")
    named = slots[slots >= 0]
    need(named.unique().numel() == named.numel(), "ssm_state_indices names the same pool slot for two sequences")
    return slots, per_token


def fused_recurrent_kda_torch(q, k, v, g, beta, *, A_log, dt_bias, scale, initial_state, output_final_state,
                              use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound,
                              cu_seqlens, state_v_first, ssm_state_indices, num_accepted_tokens):
    """PyTorch implementation behind `fused_recurrent_kda` (arguments already validated)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    out_dtype = v.dtype
    q, k, g, beta = prepare_kda_inputs(
        q, k, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    dt = q.dtype
    scale = K**-0.5 if scale is None else scale
    q, k = _expand_heads(q * scale, k, HV)
    lay = make_layout(B, T, cu_seqlens, 1, q.device)  # padded steps are identity steps (g = k = beta = 0)
    q, k, v, g, beta = (to_padded(x, lay) for x in (q, k, v.to(dt), g, beta))
    N = lay.N
    lengths = torch.tensor(lay.lengths, device=q.device)

    pool = slots = per_token = None
    if ssm_state_indices is not None:
        pool = initial_state
        slots, per_token = _check_pool(pool, ssm_state_indices, num_accepted_tokens, N, HV, K, V, state_v_first,
                                       max(lay.lengths, default=0))
        S = pool[slots.clamp(min=0)].to(dt) * (slots >= 0).to(dt).view(N, 1, 1, 1)  # [N, HV, K|V, V|K]
    elif initial_state is not None:
        S = initial_state.to(dt)
    else:
        S = q.new_zeros(N, HV, K, V)
    if state_v_first and (pool is not None or initial_state is not None):
        S = S.transpose(-1, -2)

    def write_pool(rows: torch.Tensor, slot: torch.Tensor, state: torch.Tensor) -> None:
        """pool[slot[i]] = state[rows[i]] for the named (slot >= 0) rows, in place and detached."""
        keep = slot >= 0
        if not bool(keep.any()):
            return
        src = state.detach()[rows[keep]]
        src = src.transpose(-1, -2) if state_v_first else src
        with torch.no_grad():
            pool[slot[keep]] = src.to(pool.dtype)

    outs = []
    all_rows = torch.arange(N, device=q.device)
    for t in range(lay.Tp):
        S = S * g[:, t].exp().unsqueeze(-1)  # decay first
        k_t = k[:, t].unsqueeze(-2)  # [N, HV, 1, K]
        err = v[:, t] - (k_t @ S).squeeze(-2)  # v_t - S'^T k_t   [N, HV, V]
        S = S + (beta[:, t, :, None, None] * k_t.transpose(-1, -2)) * err.unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))  # [N, HV, V]
        if per_token is not None:  # speculative decoding: the state after every real token goes to its own slot
            live = lengths > t
            write_pool(all_rows[live], per_token[live, t], S)
    if not outs:  # no tokens: return a copy, never the caller's initial_state itself
        S = S.clone()
    o = torch.stack(outs, dim=1) if outs else q.new_zeros(N, 0, HV, V)
    o = from_padded(o, lay, T).to(out_dtype)
    if pool is not None and per_token is None:
        write_pool(all_rows, slots, S)
    final = None
    if output_final_state:
        final = S.transpose(-1, -2).contiguous() if state_v_first else S
    return o, final


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    **unsupported,
):
    """Token-by-token KDA (kda.md section 5), for decode and short appends.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] log decay (raw z with `use_gate_in_kernel`);
    beta: [B, T, HV] (logits with `use_beta_sigmoid_in_kernel`); in-kernel flags, scale, lower_bound, A_log, dt_bias
    and cu_seqlens ([N+1], B == 1) as in `chunk_kda`.
    initial_state: [N, HV, K, V] fp32 ([N, HV, V, K] with `state_v_first`), or with `ssm_state_indices` the state
    pool [P, HV, K, V] that is read and updated in place (module docstring; negative index = no slot).
    num_accepted_tokens: [N] (speculative decoding) with ssm_state_indices [N, S_max]; see module docstring.
    Returns (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32 or None); the pool, if any, is updated in
    place whether or not output_final_state is set.
    """
    reject_unsupported("fused_recurrent_kda", unsupported)
    pooled = ssm_state_indices is not None
    check_kda_args("fused_recurrent_kda", q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                   state_v_first=state_v_first, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                   lower_bound=lower_bound, state_is_pool=pooled)
    if num_accepted_tokens is not None and not pooled:
        raise ValueError("fused_recurrent_kda: num_accepted_tokens needs ssm_state_indices [N, S_max] and the state "
                         "pool as initial_state")
    if pooled and initial_state is not None and initial_state.dtype not in (torch.float32, compute_dtype(q)):
        raise ValueError(f"fused_recurrent_kda: the state pool must be float32, got {initial_state.dtype}")
    impl = resolve("fused_recurrent_kda", fused_recurrent_kda_torch, like=q)
    return impl(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                lower_bound=lower_bound, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
                ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens)


def fused_recurrent_kda_pool_trusted(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    pool: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
) -> torch.Tensor:
    """Trusted engine entry (k3.serve.graphs): `fused_recurrent_kda` on a state pool WITHOUT argument validation.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV] (no cu_seqlens: B sequences of T
    tokens); pool: [P, HV, K, V] fp32, updated in place; ssm_state_indices: [B] int64 (the state after the last
    token goes there), or [B, T] (speculative verification: start from slot [:, 0], the state after token t goes to
    slot [:, t]); negative = start from zeros / write nothing. Returns o [B, T, HV, V] in v.dtype. Same semantics and arithmetic as
    `fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx, ...)`.

    The public function's checks read tensor values on the host (bool(...all()), unique(), int(max)), which a CUDA
    graph cannot capture. Here the caller must guarantee what they check, once, outside the graph: the shapes and
    dtypes above, every index in [-1, P), named (>= 0) indices distinct. The PyTorch path then does no host sync and
    allocates nothing whose size depends on data; the Triton path skips its value checks (dispatch.trusted_inputs).
    """
    kw = {"A_log": A_log, "dt_bias": dt_bias, "scale": scale, "lower_bound": lower_bound,
          "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel, "use_gate_in_kernel": use_gate_in_kernel,
          "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel}
    impl = resolve("fused_recurrent_kda", _pool_trusted_torch, like=q)
    if impl is _pool_trusted_torch:
        return _pool_trusted_torch(q, k, v, g, beta, pool=pool, idx=ssm_state_indices, **kw)
    # per-token slots [B, T] are the public API's speculative form with num_accepted_tokens = 1 (start from slot 0)
    nat = None if ssm_state_indices.dim() == 1 else torch.ones(q.shape[0], dtype=torch.long, device=q.device)
    with trusted_inputs():  # the Triton wrapper skips its host-side value checks (the caller made them)
        o, _ = impl(q, k, v, g, beta, initial_state=pool, output_final_state=False, cu_seqlens=None,
                    state_v_first=False, ssm_state_indices=ssm_state_indices, num_accepted_tokens=nat, **kw)
    return o


def _pool_trusted_torch(q, k, v, g, beta, *, pool, idx, A_log, dt_bias, scale, lower_bound, use_qk_l2norm_in_kernel,
                        use_gate_in_kernel, use_beta_sigmoid_in_kernel):
    """PyTorch body of `fused_recurrent_kda_pool_trusted`: the loop of `fused_recurrent_kda_torch` for equal-length
    rows, with the pool read and written by tensor ops only."""
    B, T, _, K = q.shape
    HV = v.shape[2]
    out_dtype = v.dtype
    q, k, g, beta = prepare_kda_inputs(
        q, k, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    dt = q.dtype
    scale = K**-0.5 if scale is None else scale
    q, k = _expand_heads(q * scale, k, HV)
    v = v.to(dt)
    per_token = idx.dim() == 2  # [B, T]: the state after token t goes to idx[:, t]; token 0 starts from idx[:, 0]
    first_idx = idx[:, 0] if per_token else idx
    named = first_idx >= 0  # [B]
    S = pool.index_select(0, first_idx.clamp(min=0)).to(dt) * named.to(dt).view(B, 1, 1, 1)  # [B, HV, K, V]
    outs, states = [], []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)  # decay first
        k_t = k[:, t].unsqueeze(-2)  # [B, HV, 1, K]
        err = v[:, t] - (k_t @ S).squeeze(-2)  # v_t - S'^T k_t   [B, HV, V]
        S = S + (beta[:, t, :, None, None] * k_t.transpose(-1, -2)) * err.unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))  # [B, HV, V]
        if per_token:
            states.append(S)
    o = (torch.stack(outs, dim=1) if outs else q.new_zeros(B, 0, HV, v.shape[-1])).to(out_dtype)
    if per_token and T:  # every token's state in one write: [B * T] rows, slots distinct where named
        _write_rows(pool, idx.reshape(-1), torch.stack(states, dim=1).flatten(0, 1))
    elif not per_token:
        _write_rows(pool, idx, S)
    return o


def _write_rows(pool: torch.Tensor, idx_B: torch.Tensor, S: torch.Tensor) -> None:
    """pool[idx_B[b]] = S[b] for the named (>= 0) rows, in place, without a boolean mask (its size would depend on
    data): an unnamed row targets the first named row's slot with that row's own new state, so an index written
    twice receives the same value twice; with no named row at all, slot 0 gets its own value back."""
    B = idx_B.shape[0]
    named, safe = idx_B >= 0, idx_B.clamp(min=0)
    first = named.to(torch.int32).argmax().view(1)  # the first named row (argmax returns the first maximum)
    tgt = torch.where(named, safe, safe.index_select(0, first))
    src = torch.where(named.view(B, 1, 1, 1), S, S.index_select(0, first))
    src = torch.where(named.index_select(0, first).view(1, 1, 1, 1), src, pool.index_select(0, tgt).to(S.dtype))
    with torch.no_grad():
        pool.index_copy_(0, tgt, src.detach().to(pool.dtype))
