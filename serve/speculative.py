"""MTP speculative decoding for the serving engine (serving.md 2.4, architecture.md 10).

The model's depth-1 MTP module drafts k = `num_speculative_tokens` tokens per running sequence; the next engine
step verifies all of them in one target forward (k3.serve.runner: per-token KDA states, latents past the accepted
length are simply overwritten later) and keeps the accepted drafts plus one target token after them (the "bonus"
token, or the resampled one after a rejection; see Acceptance below). At temperature 0 this is exactly plain greedy
decoding (tested token for token); at temperature > 0 each token has exactly the plain sampling distribution
(tested with chi-square tests), though a seeded request draws a different, equally distributed, sample than it does
without speculation (the random numbers are consumed differently).

MTP cache convention. The MTP predicts t_{j+1} from the pair (h_{j-1}, t_j), h = the main model's final hidden
before the final norm (DeepSeek-V3 arXiv 2412.19437 section 2.2: h'_i = M[RMSNorm(h_i); RMSNorm(Emb(t_{i+1}))]
predicts t_{i+2}; here j = i + 1). The pair's MLA latent is stored at **slot j**, in the same page layer stack and
block table as the main latents (one extra page layer). So a page of positions [64b, 64b + 64) holds MTP pairs that
depend only on tokens < 64(b + 1): a page published to the prefix cache is complete for the MTP too. Slot 0 never
holds a pair and is masked. Because the MTP is NoPE, a slot number only decides causality: the pair at slot j sees
slots 1..j, exactly the training-time causal mask over pairs (h_0, t_1) .. (h_{j-1}, t_j).

Per engine step and sequence (`DraftJob`): the committed tokens t_s..t_{s+c-1} of the step are paired with
[h_{s-1} (carried over in `SpecState.hidden`), h_s, ..., h_{s+c-2}] and written at slots s..s+c-1 ("catch-up");
if the sequence just sampled t_{s+c}, one more pair (h_{s+c-1}, t_{s+c}) at slot s+c gives the first draft's logits.
Drafts 2..k (k > 1) are recursive, as vLLM's MTP/EAGLE proposer does with one MTP layer: the pair for slot
s+c+r-1 is (pre-norm MTP output of the previous draft position, draft r), i.e. the MTP's own output hidden stands in
for the main hidden that does not exist yet. Those draft slots are overwritten by true pairs once their tokens are
verified. A prefix-cache hit restores h_{p-1} from the KDA snapshot at p (SnapshotStore.hidden).

Acceptance. Greedy requests: a draft is accepted while it equals the target's argmax after the request's
penalties. Sampled requests (temperature > 0): speculative sampling (Leviathan et al. 2023, arXiv 2211.17192,
Algorithm 1; Chen et al. 2023, arXiv 2302.01318): draft r is sampled from q_r, the MTP logits after the request's
own penalties / temperature / top-k / min-p / top-p (`k3.serve.sampling.token_probs`, penalties counting the tokens
before it including earlier drafts); the target accepts draft x with probability min(1, p(x)/q(x)) and, at the first
rejection, samples from norm(max(0, p - q)); after k acceptances the bonus token comes from p. Every output token is
then distributed exactly as plain sampling from p would give (tested with a chi-square test). All random draws use
the sequence's generator in a fixed order, so seeded requests are reproducible.

Legend: N sequences, T packed pairs, D width, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .runner import ModelRunner, StepSeq
from .sampling import plain_greedy


@dataclass
class SpecState:
    """Drafting state of one running sequence."""

    hidden: torch.Tensor  # [D] main final hidden h_{n-1} of the last computed token (pairs with the next token)
    drafts: list[int] = field(default_factory=list)  # tokens proposed for the next verify step
    draft_q: list[torch.Tensor] = field(default_factory=list)  # sampled requests: [V] weights each draft came from
    verify_q: torch.Tensor | None = None  # [K, V] the q rows of the drafts in the current verify step


@dataclass
class DraftJob:
    """MTP work of one sequence in one engine step: pairs (hidden[r], tokens[r]) at slots start + r."""

    block_table: list[int]
    start: int  # slot of the first pair
    tokens: list[int]  # [Tn] t_j
    hidden: torch.Tensor  # [Tn, D] h_{j-1}
    num_drafts: int = 0  # drafts to propose after the last pair (0: catch-up only)
    # sampled requests: draw(logits [V]) -> (draft token, q weights [V]); None = greedy argmax drafts
    draw: Callable[[torch.Tensor], tuple[int, torch.Tensor]] | None = None
    q: list[torch.Tensor] = field(default_factory=list)  # [V] weights each sampled draft was drawn from


def num_drafts(k: int, out_len: int, max_tokens: int, seq_len: int, max_model_len: int) -> int:
    """Drafts to propose for a sequence that has `out_len` output tokens and `seq_len` tokens in all: at most k,
    and never more than the request or the context can still take after the bonus token (so a verify step never
    writes past the pages reserved for the sequence).

    Example: num_drafts(3, out_len=10, max_tokens=12, seq_len=20, max_model_len=100) -> 1
    """
    return max(0, min(k, max_tokens - out_len - 1, max_model_len - seq_len - 1))


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


def record_acceptance(metrics, drafts: list[int], a: int) -> None:
    """Count one verify step with `a` of its drafts accepted in the k3:spec_decode_* counters (vLLM's names;
    position label 0-based)."""
    metrics.inc("k3:spec_decode_num_drafts")
    metrics.inc("k3:spec_decode_num_draft_tokens", len(drafts))
    metrics.inc("k3:spec_decode_num_accepted_tokens", a)
    for pos in range(a):
        metrics.inc("k3:spec_decode_num_accepted_tokens_per_pos", position=pos)


def verify_tokens(engine, seq, st: StepSeq, logits_TV: torch.Tensor) -> tuple[list[int], list]:
    """The engine's acceptance over a verify step's logits [K+1, V] (row j = target after tokens[:j+1]). Greedy:
    the target's token at every position up to and including the first one that differs from the draft. Sampled:
    speculative sampling against the drafts' q rows. Penalties see the tokens accepted before each position, exactly
    as one-token steps would. Returns the emitted tokens and their logprobs (the target's)."""
    drafts = st.tokens[1:]
    counts = dict(seq.counts)  # _append counts the emitted tokens again
    spec = engine._spec[id(seq)]
    if seq.params.temperature > 0:  # speculative sampling (rejection_verify)
        q_KV, spec.verify_q = spec.verify_q, None
        toks, a = rejection_verify(drafts, q_KV, lambda j: engine._probs(seq, logits_TV[j], counts), counts,
                                   seq.generator)
        lps = [engine._logprob(seq, logits_TV[j], t) for j, t in enumerate(toks)]
    else:
        saved, seq.counts = seq.counts, counts
        if plain_greedy(seq.params):  # the bare argmax at every position: one kernel and one host read
            best = logits_TV.argmax(-1).tolist()
            toks, lps = greedy_verify(drafts, lambda row: (best[row], None), seq.counts)
        else:
            toks, lps = greedy_verify(drafts, lambda row: engine._sample(seq, logits_TV[row]), seq.counts)
        seq.counts = saved
        a = accepted_prefix(drafts, toks)
    if engine.record_metrics:
        record_acceptance(engine.metrics, drafts, a)
    return toks, lps


def make_job(spec: SpecState, block_table: list[int], start: int, committed: list[int], h_rows_TD: torch.Tensor,
             new_token: int | None, k: int) -> DraftJob:
    """The MTP job of one sequence after a step that committed tokens t_start.. (`committed`, [c]) with main
    hiddens h_rows [c, D]: pairs (h_{j-1}, t_j) at slots start..start+c-1 (h_{start-1} from `spec`), plus the draft
    pair (h_{start+c-1}, new_token) when k > 0 drafts are wanted. Advances spec.hidden to h_{start+c-1}."""
    prev = spec.hidden[None].to(h_rows_TD.dtype)
    if k:
        tokens, hidden = committed + [new_token], torch.cat([prev, h_rows_TD])
    else:
        tokens, hidden = list(committed), torch.cat([prev, h_rows_TD[:-1]])
    spec.hidden = h_rows_TD[-1].clone()
    spec.drafts = []
    return DraftJob(block_table=block_table, start=start, tokens=tokens, hidden=hidden, num_drafts=k)


class MTPDrafter:
    """Runs the MTP module over the engine's pools: catch-up pairs, then k recursive drafts (argmax for greedy
    requests, sampled from q for sampled ones)."""

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int):
        if runner.model.mtp is None:
            raise ValueError("num_speculative_tokens > 0 needs a checkpoint with an MTP head (model.mtp_depth: 1); "
                             "this model has none: serve it without --speculative-tokens")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 to draft, got {num_speculative_tokens}")
        self.runner, self.k = runner, num_speculative_tokens

    def after_step(self, engine, batch, picks, out) -> None:
        """One MTP call for a whole engine step (before any sequence of it frees its pages): pairs for every
        committed token, so pages published to the prefix cache are complete for the MTP too, plus the first draft
        pair for sequences that just got a token, then the recursive drafts (stored in SpecState.drafts, with their
        q weights in SpecState.draft_q for sampled requests). batch: the engine's (seq, StepSeq, publish) items;
        picks: per item (new tokens, logprobs, committed count); out: the runner's StepOutput (hidden rows of every
        packed token). engine.draft_sampler(seq, new_tokens) gives a sampled request's draw function."""
        jobs, owners = [], []
        for (seq, st, _), (toks, _, kept), row in zip(batch, picks, out.cu):
            k = 0
            if toks and seq.status == "running":
                p = seq.params
                k = num_drafts(self.k, len(seq.output) + len(toks), p.max_tokens, len(seq.all_tokens) + len(toks),
                               engine.max_model_len)
                engine._grow(seq, st.start + kept + k)  # draft slots n .. n + k - 1 (n = tokens in the caches)
            spec = engine._spec[id(seq)]
            job = make_job(spec, seq.block_table, st.start, st.tokens[:kept], out.hidden[row:row + kept],
                           toks[-1] if k else None, k)
            if k and seq.params.temperature > 0:
                job.draw = engine.draft_sampler(seq, toks)
            jobs.append(job)
            owners.append(spec)
        for spec, job, drafts in zip(owners, jobs, self.run(jobs)):
            spec.drafts, spec.draft_q = drafts, job.q

    @torch.no_grad()
    def run(self, jobs: list[DraftJob]) -> list[list[int]]:
        """Write every job's pairs into the MTP cache and return its drafts ([] where num_drafts is 0); jobs with a
        `draw` function also get the q row [V] of each draft in job.q. The pages for slots
        start .. start + len(tokens) - 1 + num_drafts - 1 must already be in each block table."""
        drafts: list[list[int]] = [[] for _ in jobs]
        qs = [j.q for j in jobs]
        live = [i for i, j in enumerate(jobs) if j.num_drafts > 0]
        if jobs:
            seqs = [StepSeq(tokens=j.tokens, start=j.start, slot=-1, block_table=j.block_table) for j in jobs]
            x_ND, logits_NV = self.runner.mtp_step(seqs, torch.cat([j.hidden for j in jobs]))
            self._pick(jobs, live, logits_NV[live], drafts, qs)
            x_by_job = {i: x_ND[i] for i in live}
        for r in range(1, self.k):  # draft r + 1 from (MTP output at the previous draft slot, draft r)
            live = [i for i in live if jobs[i].num_drafts > r]
            if not live:
                break
            seqs = [StepSeq(tokens=[drafts[i][-1]], start=jobs[i].start + len(jobs[i].tokens) - 1 + r, slot=-1,
                            block_table=jobs[i].block_table) for i in live]
            x_ND, logits_NV = self.runner.mtp_step(seqs, torch.stack([x_by_job[i] for i in live]))
            self._pick(jobs, live, logits_NV, drafts, qs)
            for n, i in enumerate(live):
                x_by_job[i] = x_ND[n]
        return drafts

    @staticmethod
    def _pick(jobs, live, logits_LV, drafts, qs) -> None:
        """Append one draft to every live job i = live[n] from its logits row n ([L, V], L = len(live)): argmax
        (greedy) or the job's draw function (sampled)."""
        greedy = logits_LV.argmax(-1).tolist() if live else []
        for n, i in enumerate(live):
            if jobs[i].draw is None:
                drafts[i].append(greedy[n])
            else:
                tok, q_V = jobs[i].draw(logits_LV[n])
                drafts[i].append(tok)
                qs[i].append(q_V)
