"""Depthwise causal short convolution (+ SiLU) with a carried tail, in plain PyTorch (kda.md section 4).

Legend: B batch, T tokens, C channels, W kernel width, N sequences (varlen).

    y[t, c] = act( sum_{w=0}^{W-1} weight[c, w] * x[t - (W - 1) + w, c] )

x before the first token comes from `initial_tail` (the last W-1 inputs seen so far, zeros if none), so two calls
with the tail handed over equal one call on the concatenation. The tail holds PRE-conv inputs, oldest first; this
is the conv part of a KDA layer's inference cache. `weight` [C, W] is `nn.Conv1d(C, C, W, groups=C).weight[:, 0]`
(weight[:, W-1] multiplies the current token). Computed in fp32 (float64 for float64), returned in x's dtype.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ..dispatch import inputs_trusted

ACTIVATIONS = ("silu", None)


def _check(x, weight, activation, initial_tail, cu_seqlens) -> int:
    """Validate arguments; return N (rows of the tails)."""
    def need(cond, msg):
        if not cond:
            raise ValueError(f"causal_conv1d: {msg}")

    need(x.dim() == 3, f"x must be [B, T, C], got shape {tuple(x.shape)}")
    B, T, C = x.shape
    need(weight.dim() == 2 and weight.shape[0] == C and weight.shape[1] >= 1,
         f"weight must be [C={C}, W] (depthwise; use conv.weight[:, 0] of an nn.Conv1d), got {tuple(weight.shape)}")
    need(activation in ACTIVATIONS, f"activation must be 'silu' or None, got {activation!r}")
    N = B
    if cu_seqlens is not None:
        need(B == 1, f"cu_seqlens requires B == 1 (sequences packed along T), got B={B}")
        need(cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 2, f"cu_seqlens must be [N+1] with N >= 1, got "
             f"{tuple(cu_seqlens.shape)}")
        N = cu_seqlens.numel() - 1
        if not (cu_seqlens.is_cuda and inputs_trusted()):  # a trusted caller (the serving engine) built the
            cu = cu_seqlens.tolist()  # offsets on the host; for it this host read would wait for the GPU queue
            need(cu[0] == 0 and cu[-1] == T and all(a <= b for a, b in itertools.pairwise(cu)),
                 f"cu_seqlens must start at 0, be non-decreasing and end at T={T}, got {cu}")
    W = weight.shape[1]
    if initial_tail is not None:
        need(tuple(initial_tail.shape) == (N, W - 1, C),
             f"initial_tail must be [N={N}, W-1={W - 1}, C={C}] (last W-1 pre-conv inputs), got "
             f"{tuple(initial_tail.shape)}")
    return N


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    activation: str | None = "silu",
    initial_tail: torch.Tensor | None = None,
    output_final_tail: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Depthwise causal conv1d over T with an optional carried tail.

    x: [B, T, C]; weight: [C, W]; activation "silu" or None; initial_tail: [N, W-1, C] or None (zeros);
    cu_seqlens: [N+1] offsets with B == 1 (each sequence starts from its own tail row, never from its neighbour).
    Returns (y [B, T, C] in x.dtype, final_tail [N, W-1, C] in x.dtype or None): the last W-1 inputs of each
    sequence, reaching back into initial_tail when a sequence is shorter than W-1.
    """
    N = _check(x, weight, activation, initial_tail, cu_seqlens)
    B, T, C = x.shape
    W = weight.shape[1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf, wf = x.to(dt), weight.to(dt)
    if cu_seqlens is None:
        tail = x.new_zeros(B, W - 1, C, dtype=dt) if initial_tail is None else initial_tail.to(dt)
        xp = torch.cat([tail, xf], dim=1)  # [B, W-1+T, C]
        y = sum(xp[:, w : w + T] * wf[:, w] for w in range(W))
        final = xp[:, T:] if output_final_tail else None  # last W-1 rows
    else:
        # rows of one buffer: the packed tokens, then every sequence's tail (oldest first)
        tails = x.new_zeros(N, W - 1, C, dtype=dt) if initial_tail is None else initial_tail.to(dt)
        buf = torch.cat([xf[0], tails.reshape(N * (W - 1), C)])
        starts = cu_seqlens.to(x.device).long()[:-1]
        lengths = cu_seqlens.to(x.device).long().diff()

        def rows(seq, pos):  # buffer row of position `pos` (may be negative: the tail) of sequence `seq`
            in_tail = seq * (W - 1) + (W - 1) + pos + T
            return torch.where(pos >= 0, starts[seq] + pos, in_tail)

        # output_size: the lengths sum to T (checked above, or promised by a trusted caller); without it the
        # output size is read back from the device, a host wait per call on a GPU
        seq = torch.repeat_interleave(torch.arange(N, device=x.device), lengths, output_size=T)  # [T]
        local = torch.arange(T, device=x.device) - starts[seq]
        offs = torch.arange(W, device=x.device) - (W - 1)  # [W]: -(W-1) .. 0
        idx = rows(seq.unsqueeze(1), local.unsqueeze(1) + offs)  # [T, W]
        y = (buf[idx] * wf.t()).sum(1).unsqueeze(0)  # [1, T, C]
        final = None
        if output_final_tail:
            n = torch.arange(N, device=x.device).unsqueeze(1)
            final = buf[rows(n, lengths.unsqueeze(1) + offs[:-1])]  # [N, W-1, C]
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype), (final.to(x.dtype) if final is not None else None)


def check_group(xs, weights, activation, cu_seqlens, max_inputs: int | None = None) -> None:
    """Validate the arguments of causal_conv1d_multi: 1+ inputs of one shape and dtype, as many weights of one
    shape [C, W], then each pair as causal_conv1d would (cu_seqlens once)."""
    if not xs or len(xs) != len(weights) or (max_inputs is not None and len(xs) > max_inputs):
        most = f"1 to {max_inputs}" if max_inputs else "1 or more"
        raise ValueError(f"causal_conv1d_multi: give {most} inputs and one weight each, got {len(xs)} inputs and "
                         f"{len(weights)} weights")
    for x, w in zip(xs, weights):
        if x.shape != xs[0].shape or x.dtype != xs[0].dtype or w.shape != weights[0].shape:
            raise ValueError(f"causal_conv1d_multi: the inputs must share one shape and dtype and the weights one "
                             f"shape, got {[(tuple(a.shape), a.dtype) for a in xs]} and "
                             f"{[tuple(b.shape) for b in weights]}")
    _check(xs[0], weights[0], activation, None, cu_seqlens)


def causal_conv1d_multi(xs, weights, *, activation: str | None = "silu", cu_seqlens: torch.Tensor | None = None):
    """causal_conv1d of several same-shape inputs, each with its own weight, without carried tails (training).

    xs: sequence of x [B, T, C]; weights: as many [C, W]; cu_seqlens [N+1] with B == 1. Returns the tuple of
    y [B, T, C] in x's dtype. Example: q, k, v = causal_conv1d_multi([q_pre, k_pre, v_pre], [wq, wk, wv]).
    """
    check_group(xs, weights, activation, cu_seqlens)
    return tuple(causal_conv1d(x, w, activation=activation, cu_seqlens=cu_seqlens)[0] for x, w in zip(xs, weights))
