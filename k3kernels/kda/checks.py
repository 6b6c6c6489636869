"""Argument checks shared by the public KDA ops (chunk.py, fused_recurrent.py) and the shape limits they enforce.

Legend: B batch, T tokens, N sequences (B, or len(cu_seqlens) - 1 with varlen), H q/k heads, HV value heads,
K key dim, V value dim. Layout [B, T, H, D] everywhere (no head-first variant).
"""

from __future__ import annotations

import itertools

import torch

from ..dispatch import inputs_trusted
from .gate import compute_dtype

SUPPORTED_CHUNK_SIZES = (16, 32, 64)
SUB_CHUNK = 16  # BC: diagonal block size (kda.md 3.2-3.3)
MAX_HEAD_DIM = 256  # K <= 256 (the Triton state scan holds K in <= 4 register blocks of 64)
SAFE_GATE_FLOOR = -5.0  # safe_gate needs every g >= lower_bound (>= -5 when lower_bound is unset)


def host_offsets(cu_seqlens_cpu) -> list[int] | None:
    """`cu_seqlens_cpu` (a list/tuple of ints or a CPU integer tensor [N+1], or None) as a list of ints."""
    if cu_seqlens_cpu is None or isinstance(cu_seqlens_cpu, list):
        return cu_seqlens_cpu
    if isinstance(cu_seqlens_cpu, torch.Tensor):
        if cu_seqlens_cpu.device.type != "cpu" or cu_seqlens_cpu.is_floating_point() or cu_seqlens_cpu.dim() != 1:
            raise ValueError(f"cu_seqlens_cpu must be a 1-D integer CPU tensor or a list of ints, got a "
                             f"{cu_seqlens_cpu.dtype} tensor of shape {tuple(cu_seqlens_cpu.shape)} on "
                             f"{cu_seqlens_cpu.device}; pass cu_seqlens.cpu() or the offsets as a list")
        return cu_seqlens_cpu.tolist()  # a host tensor: no device wait
    return list(cu_seqlens_cpu)


def check_kda_args(fn, q, k, v, g, beta, *, initial_state, cu_seqlens, state_v_first, use_gate_in_kernel, A_log,
                   dt_bias, lower_bound, state_is_pool=False, cu_seqlens_cpu: list[int] | None = None) -> int:
    """Validate the public arguments of `fn` loudly; return N, the number of sequences (rows of the state).

    cu_seqlens_cpu: the offsets of `cu_seqlens` as host ints (see `host_offsets`), or None. With them the offset
    checks read no device value, and outside dispatch.trusted_inputs() they must equal cu_seqlens."""
    def need(cond, msg):
        if not cond:
            raise ValueError(f"{fn}: {msg}")

    for name, t, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        need(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
        need(t.dim() == nd, f"{name} must be {nd}-D ({'[B, T, HV]' if nd == 3 else '[B, T, heads, dim]'}), "
                            f"got shape {tuple(t.shape)}; the layout is [B, T, H, D] (no head-first variant)")
        need(t.is_floating_point(), f"{name} must be a floating tensor, got {t.dtype}")
    B, T, H, K = q.shape
    need(k.shape == q.shape, f"q and k must have the same shape [B, T, H, K], got q {tuple(q.shape)}, k {tuple(k.shape)}")
    need(v.shape[:2] == (B, T), f"v must be [B={B}, T={T}, HV, V], got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    need(HV % H == 0, f"value heads HV={HV} (v.shape[2]) must be a multiple of q/k heads H={H} (GVA)")
    need(K <= MAX_HEAD_DIM, f"key dim K={K} exceeds {MAX_HEAD_DIM}; split heads or use a smaller head dim")
    need(g.shape == (B, T, HV, K), f"g must be [B, T, HV, K] = {(B, T, HV, K)} (one log decay per value head and key "
                                   f"channel), got {tuple(g.shape)}")
    need(beta.shape == (B, T, HV), f"beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    N = B
    if cu_seqlens is not None:
        need(isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and not cu_seqlens.is_floating_point()
             and cu_seqlens.numel() >= 2, "cu_seqlens must be a 1-D integer tensor [N+1] of sequence offsets")
        need(B == 1, f"cu_seqlens requires B == 1 (sequences packed along T), got B={B}; flatten the batch to "
                     f"[1, total_tokens, ...] or pass cu_seqlens=None")
        N = cu_seqlens.numel() - 1
        cu = None
        if cu_seqlens_cpu is not None:  # the caller's host copy: checked for free, against the device tensor only
            cu = cu_seqlens_cpu  # for untrusted callers (that read waits for the GPU queue)
            need(len(cu) == N + 1, f"cu_seqlens_cpu must have the N+1={N + 1} entries of cu_seqlens, got {len(cu)}")
            if not inputs_trusted():
                need(cu == cu_seqlens.tolist(), f"cu_seqlens_cpu {cu} differs from cu_seqlens "
                                                f"{cu_seqlens.tolist()}; pass the same offsets (cu_seqlens.cpu())")
        elif not (cu_seqlens.is_cuda and inputs_trusted()):  # a trusted caller built the offsets on the host itself
            cu = cu_seqlens.tolist()
        if cu is not None:
            need(cu[0] == 0 and cu[-1] == T and all(a <= b for a, b in itertools.pairwise(cu)),
                 f"cu_seqlens must start at 0, be non-decreasing and end at T={T}, got {cu}")
    else:
        need(cu_seqlens_cpu is None, "cu_seqlens_cpu was given without cu_seqlens; pass both or neither")
    if lower_bound is not None:
        need(-5.0 <= lower_bound < 0.0, f"lower_bound must lie in [-5, 0), got {lower_bound}; use e.g. -5.0, "
                                        f"or lower_bound=None for the softplus gate")
    if use_gate_in_kernel:
        need(A_log is not None or lower_bound is not None,
             "use_gate_in_kernel=True with the softplus gate needs A_log [HV]; pass A_log, or set lower_bound for "
             "the lower-bound gate")
    else:
        need(A_log is None and dt_bias is None, "A_log/dt_bias are only used with use_gate_in_kernel=True; pass "
                                                "use_gate_in_kernel=True or compute g yourself (gate.py)")
    if A_log is not None:
        need(A_log.numel() == HV, f"A_log must have HV={HV} entries (one per value head), got {tuple(A_log.shape)}")
    if dt_bias is not None:
        need(dt_bias.numel() == HV * K, f"dt_bias must have HV*K={HV * K} entries, got {tuple(dt_bias.shape)}")
    if initial_state is not None and not state_is_pool:
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        need(tuple(initial_state.shape) == want,
             f"initial_state must be [N, HV, {'V, K' if state_v_first else 'K, V'}] = {want} "
             f"(state_v_first={state_v_first}), got {tuple(initial_state.shape)}")
    if initial_state is not None:
        ok = (torch.float32,) if compute_dtype(q) == torch.float32 else (torch.float32, torch.float64)
        need(initial_state.dtype in ok, f"initial_state must be float32 (float64 allowed for float64 inputs), got "
                                        f"{initial_state.dtype}; pass initial_state.float()")
    return N


def reject_unsupported(fn: str, kwargs: dict) -> None:
    """A public op's unexpected keyword arguments: fla's allow_neg_eigval named as unsupported, the rest as unknown."""
    if "allow_neg_eigval" in kwargs:
        raise NotImplementedError(f"{fn}: allow_neg_eigval (beta in (0, 2)) is not supported by k3 (kda.md section 2);"
                                  " remove the argument")
    if kwargs:
        raise TypeError(f"{fn}: unexpected keyword arguments {sorted(kwargs)}")

