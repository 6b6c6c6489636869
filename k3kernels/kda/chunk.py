"""Chunkwise KDA (`chunk_kda`): the public op, and the "triton" backend's entry and autograd Function.

Legend: B batch, T tokens, N sequences (B, or len(cu_seqlens) - 1 with varlen), H q/k heads, HV value heads, K key
dim, V value dim, BT = chunk_size, T_all = B * T (or the packed varlen length), NT_all chunks over all sequences.

`chunk_kda` checks its arguments (checks.py) and runs the backend's implementation (dispatch.resolve): on "torch"
`chunk_kda_torch` (chunk_torch.py: 16-token blocks, hand-written backward), on "triton" `chunk_kda_triton` below,
whose `_ChunkKDATriton` runs the forward kernels (triton/chunk_fwd.py) and the backward kernels (triton/chunk_bwd.py).
float64 inputs (the reference precision) run on the PyTorch implementation either way. `triton` is an optional
dependency, so the Triton modules are imported inside the functions that launch them.

Triton path. A forward that needs gradients (grad mode on and an input requiring grad) has the intra kernel store
Akk = k k^T with decay (no beta, fp32) in place of L (the solve applies beta to its row sums) and keeps Gamma, Aqk,
Akk and M, and by default (keep_states) also w, kg, qg, and v_new and the states, which its fused scan then stores
too; with KernelConfig.kda_recompute (K3_KDA_RECOMPUTE=1) the backward recomputes those (the forward's steps 3 and 4,
recompute_states). It then runs the reverse state scan, inter-chunk and intra-chunk gradient kernels.
Per token and value head this keeps Gam 4K bytes + Aqk 2 BT + Akk 4 BT + M 2 BT (bf16 inputs; the last three 512
bytes together at BT = 64) in place of g's 4K, as fla-core 0.6.0 does (its `ChunkKDAFunction` saves the gate cumsum,
Aqk and Akk and recomputes w, u and h in its backward), plus by default the states' 1,536 bytes at K = V = 128
(keep_states; u not among them: the backward takes v_new = u - w h instead). A forward without gradients
(inference) stores no Akk and keeps nothing.
KernelConfig.kda_backward (K3_KDA_BWD), read by the forward, selects the backward: "triton" (the default; tested
under the interpreter in fp32 and on an H200 in fp32 and bf16) or "torch", for which the forward keeps q, k, v, g,
beta, h0 (not Gamma, Aqk, Akk, M) and the backward recomputes the forward with the PyTorch implementation and
returns its gradients, at PyTorch speed.
The in-kernel steps run around the core under autograd: the q/k L2 norm and the gate as one Triton pass each way
(triton/norm.py, triton/gate.py), the beta sigmoid as a PyTorch op.
"""

from __future__ import annotations

import torch

from ..dispatch import active_config, check_device, resolve
from .checks import (
    SAFE_GATE_FLOOR,
    SUB_CHUNK,
    SUPPORTED_CHUNK_SIZES,
    check_kda_args,
    host_offsets,
    reject_unsupported,
)
from .chunk_torch import chunk_kda_torch


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
    **unsupported,
):
    """Chunkwise KDA (kda.md sections 3 and 5), autograd-capable.

    q, k: [B, T, H, K] (K <= 256); v: [B, T, HV, V] with HV % H == 0; g: [B, T, HV, K] log decay (raw z with
    `use_gate_in_kernel`); beta: [B, T, HV] (logits with `use_beta_sigmoid_in_kernel`).
    initial_state: [N, HV, K, V] fp32 ([N, HV, V, K] with `state_v_first`), N = B or len(cu_seqlens) - 1.
    use_qk_l2norm_in_kernel: q, k <- x / sqrt(sum x^2 + 1e-6) before `scale` (None -> K^-1/2).
    use_gate_in_kernel: g from z with A_log [HV] and dt_bias [HV*K]: lower-bound gate if `lower_bound` is set
    (A_log optional), else the softplus gate (A_log required).
    safe_gate: fixed-anchor diagonal blocks; needs every g >= lower_bound (>= -5 if unset); lower_bound in [-5, 0).
    chunk_size: 16, 32 or 64. cu_seqlens: [N+1] offsets with B == 1; chunks never straddle sequences.
    cu_seqlens_cpu: the same offsets on the host (CPU integer tensor or list of ints), from callers that have them:
    the varlen layout is then built without reading cu_seqlens back (a wait for the GPU queue). Checked against
    cu_seqlens, except inside dispatch.trusted_inputs() (the serving engine builds both from one host list).
    Returns (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32 or None), plus with
    `return_intermediate_states` h [B, NT, HV, K, V] fp32, the state entering each chunk (varlen: [1, total chunks,
    ...] in sequence order). States are float64 when the inputs are float64.
    """
    reject_unsupported("chunk_kda", unsupported)
    cu_host = host_offsets(cu_seqlens_cpu)
    check_kda_args("chunk_kda", q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                   state_v_first=state_v_first, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                   lower_bound=lower_bound, cu_seqlens_cpu=cu_host)
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_kda: chunk_size must be one of {SUPPORTED_CHUNK_SIZES}, got {chunk_size}")
    if safe_gate and use_gate_in_kernel and lower_bound is None:
        raise ValueError("chunk_kda: safe_gate=True with the in-kernel softplus gate is unbounded (g can be < -5); "
                         "pass lower_bound in [-5, 0) for the lower-bound gate, or safe_gate=False")
    impl = resolve("chunk_kda", chunk_kda_torch, like=q)
    return impl(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, safe_gate=safe_gate,
                lower_bound=lower_bound, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                return_intermediate_states=return_intermediate_states, state_v_first=state_v_first,
                cu_seqlens_cpu=cu_host)


class _ChunkKDATriton(torch.autograd.Function):
    """Triton forward; backward chosen by KernelConfig.kda_backward (Triton by default, or the PyTorch recompute),
    read when the forward runs with gradients needed (cfg["grad"]: grad mode at the call, and some input requires
    grad).

    q, k: [B, T, H, K] (unscaled; normalized, or raw with cfg["l2norm"]: the Function then normalizes them and keeps
    the normalized ones and their rstd [B T H] fp32 for the backward); v: [B, T, HV, V];
    g: [B, T, HV, K] fp32; beta: [B, T, HV]; h0: [N, HV, K, V] fp32 or None.
    Returns o [B, T, HV, V], final state [N, HV, K, V] fp32, h [NT_all, HV, K, V] (no gradient; None when the
    scan computed o, which it never does for return_intermediate_states).

    Kept for the backward (ctx.bwd):
      None (inference): nothing, and the intra kernel stores no Akk.
      "triton": q, k, v, beta, h0 and the forward's Gam fp32 [T_all, HV, K], Aqk [T_all, HV, BT] (input dtype),
        Akk fp32 [T_all, HV, BT], Mm [T_all, HV, BT] (input dtype); not g. Per token and value head that is Gam 4K
        bytes + Aqk 2 BT + Akk 4 BT + Mm 2 BT (bf16; those three 512 bytes at BT = 64) in place of g's 4K, and no
        intra or solve kernel in the backward. By default (keep_states()) also the forward's w, v_new, the states
        entering each chunk, kg and qg (chunk_fwd_pipeline's "states"; bf16 for bf16 inputs: 2 (3K + V + KV / BT)
        bytes, 1,536 at K = V = 128, BT = 64), so the backward recomputes nothing; with KernelConfig.kda_recompute
        the backward recomputes those (recompute_states), the policy of fla-core 0.6.0's `ChunkKDAFunction`
        (fla.ops.kda.chunk), which saves the gate cumsum, Aqk and Akk and recomputes w, u and h.
      "torch": q, k, v, g, beta, h0 (the PyTorch backward recomputes everything from them)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cfg):
        from .triton.chunk_fwd import chunk_fwd_pipeline
        from .triton.launch import LAUNCH, l_in_fp16, q_norm_from_output
        from .triton.norm import l2norm_fwd

        ctx.bwd = backward_impl() if cfg["grad"] and any(ctx.needs_input_grad[:6]) else None
        ctx.cfg = cfg
        norm, q_rstd = (), None
        if cfg["l2norm"]:  # q, k <- their L2 norms; the backward runs the norm's own (in the intra kernel if it can)
            if ctx.bwd is None and LAUNCH["intra"]["Q_RSTD"]:  # inference: q's rows scaled by the intra kernel
                (_, q_rstd), (k, rk) = l2norm_fwd(q, store_y=False), l2norm_fwd(k)
            else:
                (q, rq), (k, rk) = l2norm_fwd(q), l2norm_fwd(k)
                norm = (rq, rk)
        # no zero-filled gradients for unused outputs: autograd would write one for hbuf ([NT_all, HV, K, V], never
        # differentiable) on every backward, 81 us at (8, 4096, 16, 128) on an H200
        ctx.set_materialize_grads(False)
        r = chunk_fwd_pipeline(q, k, v, g, beta, h0, scale=cfg["scale"], safe_shift=cfg["safe_shift"],
                               chunk_size=cfg["chunk_size"], cu_seqlens=cfg["cu_seqlens"], h_fp32=cfg["h_fp32"],
                               store_akk=ctx.bwd == "triton", cu_host=cfg["cu_host"], g_check=cfg["g_check"],
                               keep_states=ctx.bwd == "triton" and keep_states(),
                               l_fp16=l_in_fp16(cfg["l2norm"], q.dtype), q_rstd=q_rstd)
        if ctx.bwd == "triton":
            # the output too where the backward's intra kernel takes q's norm backward from it
            ctx.o_saved = bool(norm) and q_norm_from_output(q.shape[2], v.shape[2], q.shape[3])
            ctx.save_for_backward(q, k, v, beta, h0, r["Gam"], r["Aqk"], r["Akk"], r["Mm"], *norm,
                                  *((r["o"],) if ctx.o_saved else ()), *(r["states"] or ()))
            ctx.g_dtype = g.dtype
        elif ctx.bwd == "torch":
            ctx.save_for_backward(q, k, v, g, beta, h0, *norm)
        ctx.o_meta = (r["o"].shape, r["o"].dtype, r["o"].device)  # for a zero do when only the state is used
        if r["hbuf"] is not None:  # None when the scan computed the output (launch.fuse_output)
            ctx.mark_non_differentiable(r["hbuf"])
        return r["o"], r["ht"], r["hbuf"]

    @staticmethod
    def backward(ctx, do, dht, _dh):
        from .triton.chunk_bwd import chunk_bwd_triton
        from .triton.norm import l2norm_bwd_from_y

        cfg = ctx.cfg
        if do is None:  # only the final state was used: o's gradient is zero
            shape, dtype, device = ctx.o_meta
            do = torch.zeros(shape, dtype=dtype, device=device)
        if ctx.bwd == "triton":
            q, k, v, beta, h0, Gam, Aqk, Akk, Mm, *rest = ctx.saved_tensors
            norm, rest = (rest[:2], rest[2:]) if cfg["l2norm"] else (None, rest)
            o, states = (rest[0], tuple(rest[1:])) if ctx.o_saved else (None, tuple(rest))
            if not states:  # the forward kept none (kda_recompute): the backward reruns its w/u kernel and scan
                states = recompute_states(q, k, v, beta, h0, Gam, Mm, scale=cfg["scale"], chunk_size=cfg["chunk_size"],
                                          cu_seqlens=cfg["cu_seqlens"], cu_host=cfg["cu_host"])
            grads = chunk_bwd_triton(q, k, v, beta, h0, Gam, Aqk, Akk, Mm, do, dht, scale=cfg["scale"],
                                     safe_shift=cfg["safe_shift"], chunk_size=cfg["chunk_size"],
                                     cu_seqlens=cfg["cu_seqlens"], cu_host=cfg["cu_host"], states=states, rstd=norm,
                                     o=o)
            dtypes = (q.dtype, k.dtype, v.dtype, ctx.g_dtype, beta.dtype, None)
            out = [d.to(t) if d is not None and t is not None else d for d, t in zip(grads, dtypes, strict=True)]
            return (*out, None)
        q, k, v, g, beta, h0, *norm = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() if x is not None else None for x in (q, k, v, g, beta, h0)]
            o, ht = chunk_kda_torch(*leaves[:5], scale=cfg["scale"], initial_state=leaves[5], output_final_state=True,
                                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                                    dt_bias=None, use_beta_sigmoid_in_kernel=False, safe_gate=cfg["safe_shift"]
                                    is not None, lower_bound=cfg["lower_bound"], chunk_size=cfg["chunk_size"],
                                    cu_seqlens=cfg["cu_seqlens"], return_intermediate_states=False,
                                    state_v_first=False, cu_seqlens_cpu=cfg["cu_host"])
            live = [x for x in leaves if x is not None]
            outs = [(y, dy) for y, dy in ((o, do), (ht, dht)) if dy is not None]  # dht None: the state was unused
            grads = iter(torch.autograd.grad([y for y, _ in outs], live, [dy for _, dy in outs], allow_unused=True))
        out = [next(grads) if x is not None else None for x in leaves]
        if norm:  # gradients of the normalised q, k -> of the raw ones
            out[:2] = [None if d is None else l2norm_bwd_from_y(y, r, d) for y, r, d in zip((q, k), norm, out[:2])]
        return (*out, None)


def backward_impl() -> str:
    """Which backward `_ChunkKDATriton` runs, read by its forward (which keeps what that backward needs):
    KernelConfig.kda_backward (K3_KDA_BWD): "triton" (the default: triton/chunk_bwd.py) or "torch" (recompute with
    the PyTorch path and return its gradients; slower, kept as a cross-check)."""
    return active_config().kda_backward


def keep_states() -> bool:
    """Whether a training forward keeps w, v_new, the states, kg and qg for the Triton backward (the default), or
    the backward recomputes them from Gamma and M (KernelConfig.kda_recompute, K3_KDA_RECOMPUTE=1: 1,536 bytes less
    per token and value head at K = V = 128 in bf16, 1.9 GB per layer at (1, 65536, 16, 128), for one w/u kernel and
    one state scan more per backward). Read by the forward, like backward_impl."""
    return not active_config().kda_recompute


def recompute_states(q, k, v, beta, h0, Gam, Mm, *, scale, chunk_size, cu_seqlens, cu_host=None):
    """chunk_bwd_triton's `states` when the forward kept none: a function (h_fp32, kq_dtype) -> (w, vnew, hbuf, kg,
    qg) that reruns the forward's w/u kernel and state scan (chunk_fwd_states) from its Gam [T_all, HV, K] fp32 and
    Mm [T_all, HV, BT], in the dtypes the backward asks for (launch.recompute_dtypes). q, k: [B, T, H, K]; v:
    [B, T, HV, V]; beta: [B, T, HV]; h0: [N, HV, K, V] fp32 or None. u, read by that scan alone, is not returned
    (the backward takes v_new = u - w h)."""
    from .triton.chunk_fwd import chunk_fwd_states

    def run(h_fp32: bool, kq_dtype: torch.dtype):
        w, _, vnew, hbuf, _, kg, qg = chunk_fwd_states(k, v, beta, Gam, Mm, h0, chunk_size=chunk_size,
                                                       cu_seqlens=cu_seqlens, h_fp32=h_fp32, cu_host=cu_host, q=q,
                                                       scale=scale, kq_dtype=kq_dtype)
        return w, vnew, hbuf, kg, qg

    return run


def chunk_kda_triton(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, safe_gate, lower_bound,
                     chunk_size, cu_seqlens, return_intermediate_states, state_v_first, cu_seqlens_cpu=None):
    """Triton implementation behind `chunk_kda` (arguments validated by the public function; see chunk_kda).

    Same inputs and returns as `chunk_kda_torch`: (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32 or
    None[, h [B, NT, HV, K, V] fp32]). Forward by the Triton kernels (triton/chunk_fwd.py); backward by
    triton/chunk_bwd.py (or, with KernelConfig.kda_backward "torch", by the PyTorch path).
    """
    kwargs = {"scale": scale, "initial_state": initial_state, "output_final_state": output_final_state,
              "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel, "use_gate_in_kernel": use_gate_in_kernel,
              "A_log": A_log, "dt_bias": dt_bias, "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
              "safe_gate": safe_gate,
              "lower_bound": lower_bound, "chunk_size": chunk_size, "cu_seqlens": cu_seqlens,
              "return_intermediate_states": return_intermediate_states, "state_v_first": state_v_first,
              "cu_seqlens_cpu": cu_seqlens_cpu}
    if q.dtype == torch.float64:  # the reference precision stays on the PyTorch implementation
        return chunk_kda_torch(q, k, v, g, beta, **kwargs)
    check_device("chunk_kda", q, k, v, g, beta, initial_state)
    B, _T, _, K = q.shape
    HV = v.shape[2]
    # in-kernel steps before the core: q/k L2 norm inside _ChunkKDATriton (one Triton pass each, fp32 inside, stored
    # in their dtype; its backward fused into the backward intra kernel where it can be); the gate as one Triton
    # pass (fp32 out, autograd-capable); the beta sigmoid as a PyTorch op; g fp32. beta as given (the kernels load
    # it in fp32; its gradient comes back in its dtype): a bf16 beta's cast to fp32 and its gradient's cast back
    # would be two ~3-5 us launches of each fwd+bwd
    if use_gate_in_kernel:  # one Triton pass each way (triton/gate.py; twins: gate.py)
        from .triton.gate import kda_gate_triton

        g = kda_gate_triton(g, A_log, dt_bias, lower_bound)
    g = g.float()
    beta = torch.sigmoid(beta.float()) if use_beta_sigmoid_in_kernel else beta
    safe_shift = g_check = None
    if safe_gate:
        floor = SAFE_GATE_FLOOR if lower_bound is None else lower_bound
        if not use_gate_in_kernel and g.numel():
            msg = (f"chunk_kda: safe_gate=True needs every g >= {floor} (lower_bound); clamp g to [lower_bound, 0] "
                   f"or pass safe_gate=False")
            if g.is_cuda:  # checked by the intra kernel, no host sync (a violation fails at the next synchronisation)
                g_check = (floor, msg)
            elif g.min().item() < floor:
                raise ValueError(f"{msg}; got min(g)={g.min().item():.4g}")
        s = -lower_bound if lower_bound is not None else 2.0
        safe_shift = (SUB_CHUNK - 1) * s / 2  # C = Gamma_0 - (BC - 1) s / 2 (kda.md 3.3), in nats
    h0 = None
    if initial_state is not None:
        h0 = initial_state.float()
        h0 = h0.transpose(-1, -2) if state_v_first else h0
    cfg = {"scale": K**-0.5 if scale is None else scale, "safe_shift": safe_shift, "chunk_size": chunk_size,
           "cu_seqlens": cu_seqlens, "h_fp32": return_intermediate_states, "lower_bound": lower_bound,
           "cu_host": cu_seqlens_cpu, "g_check": g_check, "l2norm": use_qk_l2norm_in_kernel,
           "grad": torch.is_grad_enabled()}  # read here: the Function's forward runs without grad mode
    o, ht, hbuf = _ChunkKDATriton.apply(q, k, v, g, beta, h0, cfg)
    final = None
    if output_final_state:
        final = ht.transpose(-1, -2).contiguous() if state_v_first else ht
    if not return_intermediate_states:
        return o, final
    h = hbuf.view(B, -1, HV, K, v.shape[3]) if cu_seqlens is None else hbuf.unsqueeze(0)
    h = h.transpose(-1, -2).contiguous() if state_v_first else h
    return o, final, h
