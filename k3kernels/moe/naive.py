"""Token-choice MoE dispatch in plain PyTorch: permute tokens by expert, grouped matmul, weighted unpermute.

Legend: N tokens, K experts per token, M = N*K routed rows, E experts, I in-features, O out-features.

Each token is copied once per selected expert and the M copies are sorted by expert (stable, so each expert's rows
stay in token order). Every expert then owns one contiguous slice of rows, and a grouped matmul runs each expert
on its slice with no Python loop over tokens. The unpermute gathers the rows back through the inverse permutation
and takes the routing-weighted sum over the K slots; this is the weighted scatter-add written as a gather.

Both row moves are gathers in the forward AND the backward (`_GatherRows`: the gradient of a gather through a
permutation is the gather through its inverse), so no float scatter, index_put or atomic add runs anywhere, the
result is deterministic on every device, and nothing in the permute or combine waits on the host (no .tolist(),
.item(), nonzero or boolean mask). The grouped matmul is sync-free where torch._grouped_mm takes its bf16 CUTLASS
path (sm90+; under autocast its operands are cast to bf16 for that); torch's fp32 CUDA path and the per-expert loop
read the group sizes on the host. The combine is an elementwise product and a sum over K, whose backward is
elementwise too: a batched [1, K] x [K, O] matmul per token (the earlier torch.bmm form) ran a slow small-tile GEMM
in its backward on the H200 (485 us a call at k3-small's N = 16384, K = 4, O = 384).

Weights use the nn.Linear layout per expert: w_EOI[e] is [out, in], so y = x @ w[e].T.

`torch._grouped_mm` (private; checked here on CPU torch 2.13 and CUDA torch 2.11, H200, fp32 and bf16) runs all
groups in one call where it exists; a one-time probe per (device type, dtype) checks it against the per-expert loop,
forward and backward, and the loop is used otherwise (float64, unaligned widths, old torch, a failing probe).
"""

from __future__ import annotations

import torch

_PROBED: dict[tuple[str, torch.dtype], bool] = {}


def moe_permute(x_ND: torch.Tensor, topk_idx_NK: torch.Tensor, num_experts: int):
    """Sort token copies by expert.

    Args: x_ND [N, D]; topk_idx_NK [N, K] int (expert ids in [0, E)); num_experts E.
    Returns: (x_MD [M, D] rows grouped by expert, order_M [M] int64 with x_MD[r] = x_ND[order_M[r] // K],
    counts_E [E] int64 rows per expert). Pass order_M to `moe_unpermute` and counts_E to `moe_grouped_mm`.

    Example: x_MD, order_M, counts_E = moe_permute(x, idx, 8); counts_E.sum() == idx.numel()
    """
    if x_ND.dim() != 2 or topk_idx_NK.dim() != 2 or x_ND.shape[0] != topk_idx_NK.shape[0]:
        raise ValueError(f"moe_permute expects x [N, D] and topk_idx [N, K] with the same N; got "
                         f"{tuple(x_ND.shape)} and {tuple(topk_idx_NK.shape)}")
    K = topk_idx_NK.shape[1]
    flat_M = topk_idx_NK.reshape(-1)
    # stable: equal expert ids keep token order, so the layout is a pure function of the routing
    order_M = torch.argsort(flat_M, stable=True)
    # scatter_add of integers, not bincount: bincount's output size depends on the data (a host sync on GPUs)
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=flat_M.device).scatter_add_(
        0, flat_M, torch.ones_like(flat_M))
    # row r holds token order_M[r] // K; the backward gathers each token's K rows back and sums them
    x_MD = _GatherRows.apply(x_ND, order_M // K, _inverse_permutation(order_M), K)
    return x_MD, order_M, counts_E


def moe_unpermute(y_MO: torch.Tensor, order_M: torch.Tensor, topk_weight_NK: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's K expert outputs: out[n] = sum_k w[n, k] * y[row of (n, k)].

    Args: y_MO [M, O] rows in expert order (as produced from `moe_permute`'s x_MD); order_M [M] from `moe_permute`;
    topk_weight_NK [N, K] routing weights (any float dtype; gradients flow into it).
    Returns out_NO [N, O] in y's dtype (the weights are cast to it; in bf16 each product w * y is rounded to bf16
    and the K-term sum accumulates in fp32, as torch's reductions do).

    Example: out = moe_unpermute(y_MO, order_M, w_NK)   # [N, O]
    """
    N, K = topk_weight_NK.shape
    M = order_M.numel()
    if y_MO.shape[0] != M or M != N * K:
        raise ValueError(f"moe_unpermute: y has {y_MO.shape[0]} rows, order has {M}, weights give N*K = {N * K}")
    y_NKO = _GatherRows.apply(y_MO, _inverse_permutation(order_M), order_M, 1).view(N, K, -1)
    # a weighted sum over the K slots: elementwise forward and backward (grad_y = w g, grad_w = sum_O g y)
    return (y_NKO * topk_weight_NK.to(y_MO.dtype).unsqueeze(-1)).sum(1)


def _inverse_permutation(order_M: torch.Tensor) -> torch.Tensor:
    """inv_M with inv_M[order_M[r]] = r: an integer scatter that writes every slot once (no host sync)."""
    return torch.empty_like(order_M).scatter_(0, order_M, torch.arange(order_M.numel(), device=order_M.device))


class _GatherRows(torch.autograd.Function):
    """out_M = x[idx_M] where every row n of x is read exactly `rep` times, by the rows inv[n*rep : (n+1)*rep].

    The backward is a gather too: grad_x[n] = sum_j grad_out[inv[n*rep + j]]. autograd's own gradient of an index
    would scatter with index_put (accumulate), which sorts the indices on CUDA; here the permutation is known.
    Used with (idx = order // K, inv = inverse of order, rep = K) to dispatch and (inv, order, 1) to combine.
    """

    @staticmethod
    def forward(ctx, x, idx_M, inv_M, rep):
        ctx.save_for_backward(inv_M)
        ctx.rep, ctx.rows = rep, x.shape[0]
        return x.index_select(0, idx_M)

    @staticmethod
    def backward(ctx, g):
        (inv_M,) = ctx.saved_tensors
        gx = g.index_select(0, inv_M)
        if ctx.rep > 1:
            gx = gx.view(ctx.rows, ctx.rep, *g.shape[1:]).sum(1)
        return gx, None, None, None


def _grouped_mm_loop(x_MI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Reference path: one matmul per expert on its contiguous slice (E host-known slice sizes)."""
    chunks = torch.split(x_MI, counts_E.tolist(), dim=0)
    return torch.cat([xc @ w_EOI[e].t() for e, xc in enumerate(chunks)], dim=0)


def _grouped_mm_gather(x_MI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Sync-free path for CUDA-graph capture where torch._grouped_mm is unavailable (e.g. fp32): each row's expert
    from the counts (searchsorted on their cumsum), its weight gathered, one batched matvec. Costs M x O x I weight
    reads, so it is only for the few rows of a decode step (the engine captures decode steps only)."""
    ends_E = torch.cumsum(counts_E, 0)
    eid_M = torch.searchsorted(ends_E, torch.arange(x_MI.shape[0], device=x_MI.device), right=True)
    eid_M = eid_M.clamp(max=w_EOI.shape[0] - 1)
    return torch.bmm(w_EOI[eid_M], x_MI.unsqueeze(-1)).squeeze(-1)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    torch._grouped_mm's backward rejects expanded (stride-0) gradients, such as the one `.sum().backward()` sends.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _grouped_mm_fused(x_MI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    offs_E = torch.cumsum(counts_E, 0).to(torch.int32)  # group end offsets, stays on device (no host sync)
    y_MO = torch._grouped_mm(x_MI, w_EOI.transpose(-2, -1), offs=offs_E)
    return _ContiguousGrad.apply(y_MO)


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Cached: does torch._grouped_mm match the per-expert loop (fwd + bwd) on this device type and dtype?"""
    key = (device.type, dtype)
    if key not in _PROBED:
        # the probe needs autograd even when the caller runs under no_grad / inference_mode / autocast
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            _PROBED[key] = _probe_once(device, dtype)
    return _PROBED[key]


def _probe_once(device: torch.device, dtype: torch.dtype) -> bool:
    """One ragged problem (an empty group included), torch._grouped_mm against the float64 loop."""
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        counts = torch.tensor([3, 0, 5, 8], device=device)
        x = torch.randn(16, 16, generator=gen).to(device, dtype).requires_grad_()
        w = torch.randn(4, 8, 16, generator=gen).to(device, dtype).requires_grad_()
        g = torch.randn(16, 8, generator=gen).to(device, dtype)
        y = _grouped_mm_fused(x, w, counts)
        dx, dw = torch.autograd.grad(y, (x, w), g)
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        y64 = _grouped_mm_loop(x64, w64, counts)
        dx64, dw64 = torch.autograd.grad(y64, (x64, w64), g.double())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False
    tol = 1e-3 if dtype == torch.float32 else 5e-2  # relative to max |value|: allows tf32 / bf16 rounding
    return all(bool((a.double() - b).abs().max() <= tol * b.abs().max()) for a, b in ((y, y64), (dx, dx64), (dw, dw64)))


def grouped_mm_available(x_MI: torch.Tensor, w_EOI: torch.Tensor) -> bool:
    """True where torch._grouped_mm exists, passed its probe on this device/dtype, and the shapes are aligned."""
    if not hasattr(torch, "_grouped_mm") or x_MI.dtype != w_EOI.dtype:
        return False
    if x_MI.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x_MI.shape[0] == 0:
        return False
    per16 = 16 // x_MI.element_size()  # row strides must be multiples of 16 bytes
    if x_MI.shape[1] % per16 or w_EOI.shape[1] % per16:
        return False
    return _probe(x_MI.device, x_MI.dtype)


def moe_grouped_mm(x_MI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Per-expert linear on contiguous row groups: y[rows of e] = x[rows of e] @ w[e].T.

    Args: x_MI [M, I] rows grouped by expert (from `moe_permute`); w_EOI [E, O, I]; counts_E [E] int rows per
    expert (sum = M); impl "auto" (torch._grouped_mm where `grouped_mm_available`, else the loop), "loop", or
    "grouped" (force torch._grouped_mm; errors where unsupported).
    Returns y_MO [M, O] in x's dtype. Differentiable in x and w.

    Example: h_MO = moe_grouped_mm(x_MI, experts.gate_up_proj, counts_E)
    """
    if x_MI.dim() != 2 or w_EOI.dim() != 3 or x_MI.shape[1] != w_EOI.shape[2] or counts_E.numel() != w_EOI.shape[0]:
        raise ValueError(f"moe_grouped_mm expects x [M, I], w [E, O, I], counts [E]; got {tuple(x_MI.shape)}, "
                         f"{tuple(w_EOI.shape)}, {tuple(counts_E.shape)}")
    if torch.is_autocast_enabled(x_MI.device.type):
        # torch._grouped_mm has no autocast rule, so fp32 inputs (an fp32 activation, fp32 expert parameters) would
        # reach its fp32 CUDA path, which loops over the groups with the offsets copied to the host (torch 2.11
        # GroupedBlas.cpp: only bf16 on sm90+ runs the sync-free CUTLASS kernel). Cast fp32 operands the way autocast
        # casts a linear's (differentiable: the gradient reaches the fp32 parameters in fp32); float64 stays.
        amp = torch.get_autocast_dtype(x_MI.device.type)
        x_MI, w_EOI = (t.to(amp) if t.dtype == torch.float32 else t for t in (x_MI, w_EOI))
    if x_MI.dtype != w_EOI.dtype and x_MI.dtype.itemsize < w_EOI.dtype.itemsize:
        # x in bf16/fp16 (an autocast linear's output) with fp32 expert weights outside autocast: cast the weights
        # likewise, so the grouped kernel runs instead of a per-expert loop with a host sync
        w_EOI = w_EOI.to(x_MI.dtype)
    if x_MI.is_cuda and torch.cuda.is_current_stream_capturing() and (impl == "loop" or x_MI.dtype != torch.bfloat16):
        # inside CUDA-graph capture only bf16 torch._grouped_mm is known to be sync-free (its CUTLASS kernel; seen
        # capturing on the H200). fp32 capture failed with a CPU<->CUDA copy on the H200 (torch 2.11), which we read
        # as its non-bf16 fallback taking the group offsets to the host; the loop needs counts.tolist() too
        return _grouped_mm_gather(x_MI, w_EOI, counts_E)
    if impl == "loop" or (impl == "auto" and not grouped_mm_available(x_MI, w_EOI)):
        return _grouped_mm_loop(x_MI, w_EOI, counts_E)
    if impl not in ("auto", "grouped"):
        raise ValueError(f"moe_grouped_mm impl must be 'auto', 'loop' or 'grouped', got {impl!r}")
    return _grouped_mm_fused(x_MI, w_EOI, counts_E)
