"""The LM head + cross-entropy fused over chunks of tokens, with the softmax gradient formed in the forward.

Legend: N tokens, C tokens of a chunk, D width, V vocab; t the targets (-100 not counted), m_i = [t_i counted].

Per chunk of C tokens, in the compute dtype cdt (the autocast dtype under autocast, else the inputs'):

    z    = h_C W^T                          [C, V] cdt, the chunk's logits (the only [., V] tensors: z and log p)
    lp   = log_softmax(z)                   [C, V] fp32 at least (float64 stays float64)
    loss += -sum_i m_i lp[i, t_i]
    G    = exp(lp) - onehot(t)              [C, V] written over z, in cdt; the target entry from fp32 before rounding
    dh_C = m * (G W)                        [C, D]
    dW  += G^T (m * h_C)                    [V, D] accumulated in fp32 (at least) across chunks

so the [N, V] logits never exist and the backward only scales the saved dh [N, D] and dW [V, D] by dL / n
(n = the number of counted targets). Masked rows enter only through m on the [C, D] side, never as a pass over
[C, V]. Published anchors of this scheme: Liger-Kernel's fused linear cross-entropy (Hsu et al., arXiv 2410.10989,
section 3.1: gradients in the forward, chunked over tokens) and Apple's Cut Cross-Entropy (Wijmans et al., arXiv
2411.09009, which goes further: blockwise in V inside one kernel).

Cost against the whole-logits path: the same three GEMMs (z, G W, G^T h), and per [C, V] element one log_softmax,
one exp and no fill, zero-initialised gradient buffer or log_softmax backward. Gradients are computed whenever the
inputs need them, even if the loss is never backpropagated.
"""

from __future__ import annotations

import torch

from ..dispatch import resolve


def softmax_rows_torch(z_CV: torch.Tensor, t_C1: torch.Tensor, lp_buf: torch.Tensor | None,
                       grad: bool) -> torch.Tensor:
    """One chunk's [C, V] step: lpt [C, 1] (the targets' log-probabilities in the softmax dtype) from the logits z
    [C, V]; with grad, z becomes softmax(z) - onehot(t) in place (the target entry from fp32 before rounding).
    lp_buf: the softmax dtype's [>= C, V] buffer (z itself when the dtypes agree on a CPU: log_softmax in place).
    The Triton kernel of loss/triton.py does the same in two reads and one write of z."""
    c = z_CV.shape[0]
    lp_CV = torch.log_softmax(z_CV, dim=-1, dtype=lp_buf.dtype, out=lp_buf[:c])
    lpt_C1 = lp_CV.gather(1, t_C1)
    if grad:
        g_CV = torch.exp(lp_CV, out=z_CV)  # softmax, rounded once to cdt
        g_CV.scatter_(1, t_C1, (lpt_C1.exp() - 1).to(z_CV.dtype))  # p_t - 1 in fp32, then rounded
    return lpt_C1


def _chunk_loss_and_grads(h_ND: torch.Tensor, w_VD: torch.Tensor, t_N: torch.Tensor, chunk: int, cdt: torch.dtype,
                          need_dh: bool, need_dw: bool):
    """(sum of the counted tokens' CE [], dh [N, D] in h's dtype or None, dW [V, D] in fp32 at least or None, n [])
    with dh, dW the gradients of the sum (not yet divided by n)."""
    N, D = h_ND.shape
    V = w_VD.shape[0]
    sdt = torch.promote_types(cdt, torch.float32)  # the softmax's dtype
    hc_ND, wc_VD = h_ND.to(cdt), w_VD.to(cdt)
    counted_N = t_N != -100
    safe_N = torch.where(counted_N, t_N, 0)  # ignored rows read column 0; m = 0 removes them
    m_N1 = counted_N.to(cdt)[:, None]
    total = torch.zeros((), dtype=sdt, device=h_ND.device)
    dh_ND = torch.empty(N, D, dtype=h_ND.dtype, device=h_ND.device) if need_dh else None
    dw_VD = torch.zeros(V, D, dtype=torch.promote_types(w_VD.dtype, torch.float32), device=w_VD.device) \
        if need_dw else None
    # the [C, V] buffers, allocated once: fresh 2 MiB CPU allocations per chunk cost their page faults; on a CPU
    # log_softmax runs in place (its kernel reads a row whole before writing it; checked against the copy in tests)
    C = min(chunk, N)
    z_buf = torch.empty(C, V, dtype=cdt, device=h_ND.device)
    rows = softmax_rows_torch if cdt == torch.float64 else resolve("softmax_rows", softmax_rows_torch, like=z_buf)
    in_place = sdt == cdt and h_ND.device.type == "cpu"
    if rows is not softmax_rows_torch:
        lp_buf = None  # the Triton kernel needs no softmax buffer
    else:
        lp_buf = z_buf if in_place else torch.empty(C, V, dtype=sdt, device=h_ND.device)
    grad = need_dh or need_dw
    for i in range(0, N, chunk):
        h_CD, t_C1, m_C1 = hc_ND[i:i + chunk], safe_N[i:i + chunk, None], m_N1[i:i + chunk]
        c = h_CD.shape[0]
        z_CV = torch.mm(h_CD, wc_VD.T, out=z_buf[:c])
        lpt_C1 = rows(z_CV, t_C1, lp_buf, grad)
        total -= (lpt_C1 * m_C1).sum()
        if not grad:
            continue
        g_CV = z_CV  # softmax - onehot, in place
        if need_dh:
            if dh_ND.dtype == cdt:
                torch.mm(g_CV, wc_VD, out=dh_ND[i:i + c]).mul_(m_C1)
            else:
                dh_ND[i:i + c] = (g_CV @ wc_VD).mul_(m_C1)
        if need_dw:
            hm_CD = h_CD * m_C1
            if dw_VD.dtype == cdt:
                dw_VD.addmm_(g_CV.T, hm_CD)
            else:  # bf16 GEMM: each chunk's partial rounded once, the sum over chunks in fp32
                dw_VD += g_CV.T @ hm_CD
    return total, dh_ND, dw_VD, counted_N.sum()


class LinearCrossEntropy(torch.autograd.Function):
    """mean CE of (h W^T) against t, its gradients formed in the forward (module docstring). Not for direct use:
    `k3.kernels.loss.linear_cross_entropy` checks the inputs and picks the compute dtype and chunk."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, t_N, chunk: int, cdt: torch.dtype, need_dh: bool, need_dw: bool):
        with torch.autocast(h_ND.device.type, enabled=False):  # the dtypes are chosen explicitly (cdt)
            total, dh_ND, dw_VD, n = _chunk_loss_and_grads(h_ND, w_VD, t_N, chunk, cdt, need_dh, need_dw)
        ctx.save_for_backward(dh_ND, dw_VD, n)
        ctx.w_dtype = w_VD.dtype
        return total / n  # NaN when nothing is counted, as F.cross_entropy's mean

    @staticmethod
    def backward(ctx, g):
        dh_ND, dw_VD, n = ctx.saved_tensors
        s = g / n.clamp_min(1)  # nothing counted: zero gradients, as F.cross_entropy gives
        dh = None if dh_ND is None else dh_ND * s.to(dh_ND.dtype)
        dw = None if dw_VD is None else (dw_VD * s).to(ctx.w_dtype)
        return dh, dw, None, None, None, None, None


def chunked_linear_cross_entropy(h_ND: torch.Tensor, w_VD: torch.Tensor, t_N: torch.Tensor, chunk: int,
                                 cdt: torch.dtype) -> torch.Tensor:
    """The autograd entry: gradients only for inputs that need them under grad mode (none under no_grad)."""
    grad = torch.is_grad_enabled()
    need_dh, need_dw = grad and h_ND.requires_grad, grad and w_VD.requires_grad
    if not (need_dh or need_dw):
        with torch.autocast(h_ND.device.type, enabled=False):
            total, _, _, n = _chunk_loss_and_grads(h_ND, w_VD, t_N, chunk, cdt, False, False)
        return total / n
    return LinearCrossEntropy.apply(h_ND, w_VD, t_N, chunk, cdt, need_dh, need_dw)
