"""Distillation losses on completion tokens (pure functions; `k3 distill`, k3.train.distill).

Every loss takes the student's logits [N, V] (the graph the gradient flows through), the teacher's log-probabilities
[N, V] (no gradient), the sampled tokens [N] and the mask [N] of completion targets, and returns the mean over the
masked tokens. N is B*T flattened; V the shared vocabulary.

- reverse_kl: KL(student || teacher) over the full vocabulary per token (MiniLLM; Thinking Machines' on-policy
  distillation, where it is the per-token objective).
- sampled_reverse_kl: the sampled token's log-ratio log p_s(x) - log p_t(x) as a per-token advantage with discount 0
  (Thinking Machines, "On-Policy Distillation", 2025): loss = mean (log p_s(x) - log p_t(x)).detach() * log p_s(x).
  On tokens drawn from the student its gradient is an unbiased estimate of reverse_kl's, at O(1) per token of the
  teacher instead of O(V): sum_x p_s(x) r(x) grad log p_s(x) = grad KL(s || t), since sum_x grad p_s(x) = 0.
- forward_kl: KL(teacher || student).
- jsd: GKD's generalized Jensen-Shannon divergence (Agarwal et al. 2024, eq. 1; TRL's GKDTrainer): with the mixture
  m = beta * p_t + (1 - beta) * p_s, JSD(beta) = beta * KL(t || m) + (1 - beta) * KL(s || m). beta = 0 is forward
  KL and beta = 1 reverse KL (TRL's convention at the end points; JSD(beta) / beta tends to forward KL as beta -> 0
  and JSD(beta) / (1 - beta) to reverse KL as beta -> 1); beta = 0.5 is the symmetric JSD.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LOSSES = ("reverse_kl", "sampled_reverse_kl", "forward_kl", "jsd")


def _f32(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16 logits are promoted; float64 references stay float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _masked_mean(x_N: torch.Tensor, mask_N: torch.Tensor) -> torch.Tensor:
    m = mask_N.to(x_N.dtype)
    return (x_N * m).sum() / m.sum().clamp_min(1)


def _kl_rows(logp_NV: torch.Tensor, logq_NV: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row [N] from log-probabilities (0 * log 0 = 0 where p vanishes)."""
    p = logp_NV.exp()
    return torch.where(p > 0, p * (logp_NV - logq_NV), torch.zeros_like(p)).sum(-1)


def token_reverse_kl(student_logits_NV: torch.Tensor, teacher_logp_NV: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher) of every position [N] in nats, without a gradient path to the teacher."""
    return _kl_rows(F.log_softmax(_f32(student_logits_NV), -1), _f32(teacher_logp_NV))


def reverse_kl(student_logits_NV, teacher_logp_NV, tokens_N, mask_N) -> torch.Tensor:
    return _masked_mean(token_reverse_kl(student_logits_NV, teacher_logp_NV.detach()), mask_N)


def forward_kl(student_logits_NV, teacher_logp_NV, tokens_N, mask_N) -> torch.Tensor:
    logs = F.log_softmax(_f32(student_logits_NV), -1)
    return _masked_mean(_kl_rows(_f32(teacher_logp_NV.detach()), logs), mask_N)


def sampled_reverse_kl(student_logits_NV, teacher_logp_NV, tokens_N, mask_N) -> torch.Tensor:
    logs = F.log_softmax(_f32(student_logits_NV), -1)
    ls_N = logs.gather(-1, tokens_N.clamp_min(0)[:, None])[:, 0]
    lt_N = _f32(teacher_logp_NV.detach()).gather(-1, tokens_N.clamp_min(0)[:, None])[:, 0]
    advantage_N = (ls_N - lt_N).detach()  # discount 0: each token's own log-ratio, no return over later tokens
    return _masked_mean(advantage_N * ls_N, mask_N)


def jsd(student_logits_NV, teacher_logp_NV, tokens_N, mask_N, beta: float = 0.5) -> torch.Tensor:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"distill.beta={beta} must lie in [0, 1]")
    if beta == 0.0:
        return forward_kl(student_logits_NV, teacher_logp_NV, tokens_N, mask_N)
    if beta == 1.0:
        return reverse_kl(student_logits_NV, teacher_logp_NV, tokens_N, mask_N)
    logs = F.log_softmax(_f32(student_logits_NV), -1)
    logt = _f32(teacher_logp_NV.detach())
    logm = torch.logsumexp(torch.stack([logt + math.log(beta), logs + math.log(1 - beta)]), 0)
    per = beta * _kl_rows(logt, logm) + (1 - beta) * _kl_rows(logs, logm)
    return _masked_mean(per, mask_N)


def distill_loss(kind: str, student_logits_NV: torch.Tensor, teacher_logp_NV: torch.Tensor, tokens_N: torch.Tensor,
                 mask_N: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """The `distill.loss` objective `kind` (one of LOSSES), mean over the masked tokens.

    Example: distill_loss("reverse_kl", logits, teacher_logits.log_softmax(-1), tokens, mask)"""
    if kind == "jsd":
        return jsd(student_logits_NV, teacher_logp_NV, tokens_N, mask_N, beta)
    fns = {"reverse_kl": reverse_kl, "sampled_reverse_kl": sampled_reverse_kl, "forward_kl": forward_kl}
    if kind not in fns:
        raise ValueError(f"distill.loss={kind!r}: use one of {list(LOSSES)}")
    return fns[kind](student_logits_NV, teacher_logp_NV, tokens_N, mask_N)
