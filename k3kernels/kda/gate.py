"""KDA gates, beta and q/k normalization in plain PyTorch (kda.md section 2).

Legend: B batch, T tokens, H query/key heads, HV value heads, K key dim.

    softplus gate (Kimi Linear):  g = -exp(A_log[h]) * softplus(z + dt_bias)          in (-inf, 0)
    lower-bound gate (K3):        g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias))     in (lb, 0), lb in [-5, 0)
                                  without A_log: g = lb * sigmoid(z + dt_bias)
    beta = sigmoid(logits);   l2norm(x) = x / sqrt(sum(x^2) + 1e-6)

Sources: Kimi Linear (arXiv 2510.26692); fla-org/flash-linear-attention `fla/ops/kda/gate.py` (parametrization only).
The bias is added before the exp(A_log) scale; A_log is per head [HV], dt_bias per channel [HV*K].

`prepare_kda_inputs` applies the optional "in-kernel" steps of `chunk_kda` / `fused_recurrent_kda` so both kernels
(and a future Triton kernel's torch twin) share one definition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # inside the sqrt, as in fla's l2norm


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for every input dtype except float64, which stays float64 (the reference precision)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2, -1) + eps), computed in the dtype of x. x: [..., D] -> [..., D]."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _biased(z: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """z [..., HV, K] (in the compute dtype) plus dt_bias [HV*K] reshaped per head."""
    if dt_bias is None:
        return z
    HV, K = z.shape[-2:]
    return z + dt_bias.to(z.dtype).view(HV, K)


def check_gate_args(A_log: torch.Tensor | None, lower_bound: float | None) -> None:
    """The gate's own argument checks (the twins here and triton.gate.kda_gate_triton): lower_bound in [-5, 0) for
    the lower-bound gate; A_log for the softplus gate (lower_bound None)."""
    if lower_bound is not None and not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"lower_bound must lie in [-5, 0), got {lower_bound}; use e.g. lower_bound=-5.0")
    if lower_bound is None and A_log is None:
        raise ValueError("the softplus gate needs A_log [HV]; pass A_log, or lower_bound for the lower-bound gate")


def naive_kda_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Kimi Linear softplus gate g = -exp(A_log[h]) * softplus(z + dt_bias).

    z: [B, T, HV, K] raw gate projection; A_log: [HV]; dt_bias: [HV*K] or None.
    Returns g: [B, T, HV, K] in fp32 (float64 if z is float64), every entry < 0 (up to underflow).
    """
    dt = compute_dtype(z)
    HV = z.shape[-2]
    zb = _biased(z.to(dt), dt_bias)
    return -A_log.to(dt).view(HV, 1).exp() * F.softplus(zb)


def naive_kda_lowerbound_gate(
    z: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """K3 lower-bound gate g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias)); without A_log lb * sigmoid(z + dt_bias).

    z: [B, T, HV, K]; A_log: [HV] or None; dt_bias: [HV*K] or None; lower_bound lb in [-5, 0).
    Returns g: [B, T, HV, K] in fp32 (float64 if z is float64), entries in (lb, 0).
    """
    check_gate_args(A_log, lower_bound)
    dt = compute_dtype(z)
    HV = z.shape[-2]
    x = _biased(z.to(dt), dt_bias)
    if A_log is not None:
        x = A_log.to(dt).view(HV, 1).exp() * x
    return lower_bound * torch.sigmoid(x)


def prepare_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    use_beta_sigmoid_in_kernel: bool,
):
    """Apply the optional in-kernel steps and cast to the compute dtype (fp32, or float64 for float64 inputs).

    q, k: [B, T, H, K]; g: [B, T, HV, K] (log decay, or raw z with the in-kernel gate); beta: [B, T, HV]
    (probabilities, or logits with the in-kernel sigmoid). Returns (q, k, g, beta) in the compute dtype.
    """
    dt = compute_dtype(q)
    q, k, g, beta = q.to(dt), k.to(dt), g.to(dt), beta.to(dt)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        if lower_bound is not None:
            g = naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound)
        else:
            g = naive_kda_gate(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta)
    return q, k, g, beta
