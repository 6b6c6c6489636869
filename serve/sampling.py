"""Token sampling: greedy, temperature, top-k, top-p (nucleus), min-p. Sync-free on the device.

Legend: B batch, V vocab.
"""

from __future__ import annotations

import torch


def sample(logits_BV: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
           min_p: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of logits [B, V] -> [B] int64. temperature 0 means greedy (argmax, lowest index on ties).

    Example: sample(torch.tensor([[0., 5., 1.]]), temperature=0) -> tensor([1])
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits = logits_BV.float() / temperature
    if top_k and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
