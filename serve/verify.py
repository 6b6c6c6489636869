"""MTP speculative decoding, the verify side: which drafts the target accepts (serving.md 2.4).

Greedy requests: a draft is accepted while it equals the target's argmax after the request's penalties
(`greedy_verify`; on the device for plain greedy rows, `accept_lengths`). Sampled requests (temperature > 0):
speculative sampling (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1; Chen et al. 2023, arXiv 2302.01318,
`rejection_verify`): the target accepts draft x with probability min(1, p(x)/q(x)) and, at the first rejection,
samples from norm(max(0, p - q)); after k acceptances the bonus token comes from p. Every output token is then
distributed exactly as plain sampling from p would give (tested with a chi-square test). All random draws use the
sequence's generator in a fixed order, so seeded requests are reproducible.

The rollback's device helpers (`commit_src`, `latent_rows`) compute on the device what the host layouts compute for
the one-sync step (k3.serve.spec_step).

Legend: B sequences, K drafts, V vocab.
"""

from __future__ import annotations

import torch


def accepted_prefix(drafts: list[int], targets: list[int]) -> int:
    """Number of leading drafts equal to the target's choices (greedy acceptance); targets[i] is the target's token
    at the position of drafts[i].

    Example: accepted_prefix([5, 7, 9], [5, 7, 2, 4]) -> 2
    """
    a = 0
    while a < len(drafts) and a < len(targets) and drafts[a] == targets[a]:
        a += 1
    return a


def greedy_verify(drafts: list[int], pick, counts: dict[int, int]) -> tuple[list[int], list]:
    """Greedy acceptance of one verify step. pick(j) -> (token, logprob) is the target's choice at position j
    (after the request's penalties, which read `counts`); position j follows the step's first token and drafts[:j].
    Returns the target's tokens up to and including the first one that differs from its draft (all len(drafts) + 1
    when every draft matches: the last one is the bonus token). `counts` is updated with each picked token so the
    penalties at j see the tokens accepted before it, as one-token steps would.

    Example: with pick(j) = ([5, 7, 2, 4][j], None): greedy_verify([5, 7, 9], pick, {}) -> ([5, 7, 2], [None] * 3)
    """
    toks, lps = [], []
    for j in range(len(drafts) + 1):
        tok, lp = pick(j)
        toks.append(tok)
        lps.append(lp)
        counts[tok] = counts.get(tok, 0) + 1
        if j == len(drafts) or tok != drafts[j]:
            break
    return toks, lps


def rejection_verify(drafts: list[int], q_KV: torch.Tensor, p_at, counts: dict[int, int],
                     generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Speculative sampling over one verify step (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1).
    drafts [K] were sampled from the draft weights q_KV [K, V] (row r: the distribution draft r was drawn from, any
    non-negative weights); p_at(j) -> [V] gives the target's weights at position j (after drafts[:j]; it may read
    `counts`, which is updated with each emitted token as one-token steps would). Rows need not be normalized.
    Draft x is accepted with probability min(1, p(x)/q(x)); the first rejection emits a sample from
    norm(max(0, p - q)) and stops; if all K are accepted, a bonus token is sampled from p_at(K).
    Returns (emitted tokens: accepted drafts + one more, number of accepted drafts).

    Example: with q_KV = p rows (draft == target) every draft is accepted: -> (drafts + [bonus], K)
    """
    if q_KV is None or q_KV.shape[0] != len(drafts):
        shape = None if q_KV is None else tuple(q_KV.shape)
        raise ValueError(f"rejection_verify needs one q row per draft: {len(drafts)} drafts, q rows {shape}")
    out: list[int] = []
    for j, x in enumerate(drafts):
        p_V = p_at(j).float()
        p_V = p_V / p_V.sum()
        q_V = q_KV[j].float()
        q_V = q_V / q_V.sum()
        u = torch.rand((), generator=generator, device=p_V.device)
        if bool(u * q_V[x] < p_V[x]):  # u < p/q, i.e. accept with probability min(1, p(x)/q(x))
            out.append(x)
            counts[x] = counts.get(x, 0) + 1
            continue
        resid = (p_V - q_V).clamp_min(0.0)
        # the residual has zero mass only when p == q up to rounding, where a rejection has probability ~0
        w = resid if bool(resid.sum() > 0) else p_V
        tok = int(torch.multinomial(w, 1, generator=generator))
        out.append(tok)
        counts[tok] = counts.get(tok, 0) + 1
        return out, j
    tok = int(torch.multinomial(p_at(len(drafts)).float(), 1, generator=generator))
    counts[tok] = counts.get(tok, 0) + 1
    out.append(tok)
    return out, len(drafts)


def accept_lengths(targets_BT: torch.Tensor, drafts_BK: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance on the device: kept [B] = 1 + the number of leading positions where the target's token
    targets [B, K + 1] (row j: the argmax after the step's tokens[:j+1]) equals the draft drafts [B, K]; tensor ops
    only (no host read). Same as speculative.accepted_prefix + 1 per row.

    Example: accept_lengths(tensor([[5, 7, 2, 4]]), tensor([[5, 7, 9]])) -> tensor([3])"""
    K = drafts_BK.shape[1]
    match = (targets_BT[:, :K] == drafts_BK).long().cumprod(1)  # [B, K]: 1 while every draft so far matched
    return match.sum(1) + 1


def commit_src(kept_B: torch.Tensor, slots_B: torch.Tensor, num_slots: int, spec_tokens: int) -> torch.Tensor:
    """StatePool.token_slot(slot, kept - 1) on the device, [B]: the working slot itself for kept = 1, else the
    scratch row num_slots + slot * spec_tokens + kept - 2 (the state after the last kept token)."""
    return torch.where(kept_B == 1, slots_B, num_slots + slots_B * spec_tokens + kept_B - 2)


def latent_rows(pos_B: torch.Tensor, table_BG: torch.Tensor, page: int) -> torch.Tensor:
    """Flat latent row [B] of position pos_B[n] through block table row n ([B, G]): table[pos // page] * page +
    pos % page, as the host layouts (k3.serve.static) compute it."""
    return table_BG.gather(1, (pos_B // page)[:, None])[:, 0] * page + pos_B % page
