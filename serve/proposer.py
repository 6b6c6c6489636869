"""MTP speculative decoding, the proposer side: drafts from the model's MTP block (serving.md 2.4, architecture.md 10).

The model's depth-1 MTP module drafts k = `num_speculative_tokens` tokens per running sequence; the next engine
step verifies all of them in one target forward (k3.serve.runner: per-token KDA states, latents past the accepted
length are simply overwritten later) and keeps the accepted drafts plus one target token after them (the "bonus"
token, or the resampled one after a rejection; k3.serve.verify). At temperature 0 this is exactly plain greedy
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

Drafts of sampled requests are drawn from q_r, the MTP logits after the request's own penalties / temperature /
top-k / min-p / top-p (the engine's `draw` function of the job, penalties counting the tokens before the draft
including earlier drafts), and their q rows kept for the verify side (k3.serve.verify).

Legend: N sequences, T packed pairs, D width, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .runner import ModelRunner
from .step import StepSeq


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


class MTPProposer:
    """Runs the model's MTP block over the engine's pools: catch-up pairs, then k recursive drafts (argmax for
    greedy requests, drawn by the job's `draw` function for sampled ones)."""

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int):
        if runner.model.mtp is None:
            raise ValueError("num_speculative_tokens > 0 needs a checkpoint with an MTP head (model.mtp_depth: 1); "
                             "this model has none: serve it without --speculative-tokens")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 to draft, got {num_speculative_tokens}")
        self.runner, self.k = runner, num_speculative_tokens

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
