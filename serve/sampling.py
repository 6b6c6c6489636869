"""Token sampling: penalties, greedy, temperature, top-k, top-p (nucleus), min-p. Sync-free on the device.

`token_probs` is the processed distribution a sampled request draws from; speculative sampling
(k3.serve.speculation, k3.serve.verify) uses it for both the target p and the draft q, so both see the same
processing. The per-request helpers at the end apply a Sequence's own parameters, counts and generator.
Legend: B batch, V vocab.
"""

from __future__ import annotations

import torch

from .request import TokenLogprob, token_logprob


def apply_penalties(logits_V: torch.Tensor, params, counts: dict[int, int], prompt: list[int]) -> torch.Tensor:
    """Presence/frequency and repetition penalties of a request (`params`: SamplingParams) on one row [V] -> [V];
    `counts` maps generated token -> occurrences, `prompt` the prompt ids. Returns the input when no penalty is on.

    Example: apply_penalties(torch.zeros(3), SamplingParams(presence_penalty=1.0), {2: 1}, []) -> [0., 0., -1.]
    """
    p = params
    logits = logits_V
    if (p.presence_penalty or p.frequency_penalty) and counts:
        ids = torch.tensor(list(counts), device=logits_V.device)
        cnt = torch.tensor(list(counts.values()), device=logits_V.device, dtype=logits_V.dtype)
        # OpenAI's definition: mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence
        logits = logits.clone()
        logits[ids] -= cnt * p.frequency_penalty + p.presence_penalty
    if p.repetition_penalty != 1.0:
        # Keskar et al. 2019 (CTRL, arXiv 1909.05858 section 4.1) as vLLM applies it: over prompt + output
        seen = torch.tensor(sorted(set(prompt) | set(counts)), device=logits_V.device)
        logits = logits.clone()
        x = logits[seen]
        logits[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    return logits


def _check(temperature: float, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


def token_probs(logits_BV: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                min_p: float = 0.0) -> torch.Tensor:
    """The fp32 sampling weights [B, V] for temperature > 0: softmax(logits / T) restricted by top-k, min-p and
    top-p, not renormalized (rows sum to the kept mass <= 1; torch.multinomial accepts unnormalized weights, divide
    by the row sum for a distribution).

    Example: token_probs(torch.tensor([[0., 0., -1e9]])) -> [[0.5, 0.5, 0.]]
    """
    _check(temperature, top_p)
    if temperature == 0:
        raise ValueError("token_probs needs temperature > 0 (temperature 0 is argmax)")
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
        drop[:, 0] = False  # the top token always stays: a top_p below float32's range (5e-324) rounds to 0
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return probs


def plain_greedy(params) -> bool:
    """True for a request whose next token is the bare argmax of the logits: temperature 0, no penalties, no
    logprobs (SamplingParams). The engine batches these rows into one argmax."""
    return (params.temperature == 0 and params.logprobs is None and not params.presence_penalty
            and not params.frequency_penalty and params.repetition_penalty == 1.0)


def greedy_picks(items: list, logits: list) -> dict[int, int]:
    """Engine step helper: item index -> next token for the (Sequence, StepSeq) items that take a plain greedy token
    this step (running, prefill done after the step, no verify, plain_greedy params): one argmax over their stacked
    last logit rows and one host read instead of one each; the same argmax as `sample(temperature=0)`."""
    rows = [i for i, (seq, st) in enumerate(items)
            if not st.spec and seq.status == "running" and st.start + len(st.tokens) >= len(seq.prompt)
            and seq.params.max_tokens > 0 and plain_greedy(seq.params)]
    if len(rows) < 2:
        return {}
    # "last" rows are already [1, V]: concatenating them skips a select op per row (~1 µs of host time each)
    last = torch.cat([logits[i] if items[i][1].logits == "last" else logits[i][-1:] for i in rows])  # [N, V]
    return dict(zip(rows, last.argmax(-1).tolist(), strict=True))


def sample(logits_BV: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
           min_p: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of logits [B, V] -> [B] int64. temperature 0 means greedy (argmax, lowest index on ties).

    Example: sample(torch.tensor([[0., 5., 1.]]), temperature=0) -> tensor([1])
    """
    _check(temperature, top_p)
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    probs = token_probs(logits_BV, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ---------------------------------------------------------------------------------------------------- per request
# (seq: a k3.serve.request.Sequence: its params, generated-token counts, prompt and generator)


def pick_token(seq, row_V: torch.Tensor) -> tuple[int, TokenLogprob | None]:
    """A request's next token from fp32 logits [V] (penalties, then its sampling); logprobs are the model's raw
    log-softmax (before penalties and temperature, vLLM's default)."""
    p = seq.params
    logits = apply_penalties(row_V, p, seq.counts, seq.prompt)
    tok = int(sample(logits[None], temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                     generator=seq.generator)[0])
    return tok, logprob_of(seq, row_V, tok)


def logprob_of(seq, row_V: torch.Tensor, tok: int) -> TokenLogprob | None:
    """The logprob entry of token `tok` (with the request's top-k alternatives), None without logprobs."""
    k = seq.params.logprobs
    return None if k is None else token_logprob(torch.log_softmax(row_V.float(), -1), tok, k)


def request_probs(seq, row_V: torch.Tensor, counts: dict[int, int]) -> torch.Tensor:
    """The weights [V] a sampled request draws from after `counts` generated tokens (penalties included)."""
    p = seq.params
    logits = apply_penalties(row_V, p, counts, seq.prompt)
    return token_probs(logits[None], temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p)[0]


def draft_sampler(seq, new_tokens: list[int]):
    """The MTP draw function of a sampled request whose step just produced `new_tokens` (not yet appended): draft r
    is drawn from q = the request's processed distribution of the MTP logits, with penalties counting the output
    so far, `new_tokens` and drafts 1..r-1, i.e. exactly what the target sees at that position."""
    counts = dict(seq.counts)
    for t in new_tokens:
        counts[t] = counts.get(t, 0) + 1

    def draw(logits_V: torch.Tensor) -> tuple[int, torch.Tensor]:
        q_V = request_probs(seq, logits_V.float(), counts)
        tok = int(torch.multinomial(q_V, 1, generator=seq.generator))
        counts[tok] = counts.get(tok, 0) + 1
        return tok, q_V

    return draw
