"""MTP speculative decoding in the engine: the glue between its requests and k3.serve's speculative layer (serving.md
2.4). `Speculation` holds the MTP proposer and the one-sync step of one engine and, per step, accepts the drafts of
verify steps (greedy match, or speculative sampling for temperature > 0; k3.serve.verify), drafts the next k after
the MTP catches up on the committed tokens (k3.serve.proposer), and runs all-greedy verify steps on the one-sync
path (k3.serve.spec_step). The speculative modules receive data from here, never the engine.

Legend: K drafts, V vocab.
"""

from __future__ import annotations

import torch

from .output import OutputProcessor
from .pools import SnapshotStore
from .proposer import MTPProposer, SpecState, make_job, num_drafts
from .request import Sequence
from .runner import ModelRunner
from .sampling import draft_sampler, logprob_of, pick_token, plain_greedy, request_probs
from .scheduler import Scheduled, Scheduler
from .spec_step import OneSyncStep
from .verify import accepted_prefix, greedy_verify, rejection_verify


class Speculation:
    """Speculative decoding with k MTP drafts per step for one engine (module docstring)."""

    def __init__(self, runner: ModelRunner, k: int, scheduler: Scheduler, output: OutputProcessor,
                 snaps: SnapshotStore | None, max_model_len: int):
        self.runner, self.scheduler, self.output, self.snaps = runner, scheduler, output, snaps
        self.max_model_len, self.block_size = max_model_len, scheduler.block_size
        self.proposer = MTPProposer(runner, k)
        self.one_sync: OneSyncStep | None = OneSyncStep(runner, k)  # None: every step on the host path
        self.d_model, self.device = runner.cfg.d_model, runner.device

    def on_admit(self, seq: Sequence, entry: int | None) -> None:
        """A sequence starts running: with speculation its drafting state, h_{p-1} from the snapshot after a hit."""
        hidden = self.snaps.read_hidden(entry) if entry is not None else torch.zeros(self.d_model,
                                                                                     device=self.device)
        seq.spec = SpecState(hidden=hidden)

    def verify_tokens(self, seq: Sequence, st, logits_TV: torch.Tensor) -> tuple[list[int], list]:
        """Acceptance over a verify step's logits [K+1, V] (row j = target after tokens[:j+1]). Greedy: the target's
        token at every position up to and including the first one that differs from the draft. Sampled:
        speculative sampling against the drafts' q rows. Penalties see the tokens accepted before each position,
        as one-token steps would. Returns the emitted tokens and their logprobs (the target's)."""
        drafts = st.tokens[1:]
        counts = dict(seq.counts)  # appending counts the emitted tokens again
        spec = seq.spec
        if seq.params.temperature > 0:  # speculative sampling
            q_KV, spec.verify_q = spec.verify_q, None
            toks, a = rejection_verify(drafts, q_KV, lambda j: request_probs(seq, logits_TV[j], counts), counts,
                                       seq.generator)
            lps = [logprob_of(seq, logits_TV[j], t) for j, t in enumerate(toks)]
        else:
            saved, seq.counts = seq.counts, counts
            if plain_greedy(seq.params):  # the bare argmax at every position: one kernel and one host read
                best = logits_TV.argmax(-1).tolist()
                toks, lps = greedy_verify(drafts, lambda row: (best[row], None), seq.counts)
            else:
                toks, lps = greedy_verify(drafts, lambda row: pick_token(seq, logits_TV[row]), seq.counts)
            seq.counts = saved
            a = accepted_prefix(drafts, toks)
        self.output.acceptance(drafts, a)
        return toks, lps

    def draft(self, batch: list[Scheduled], picks, out) -> None:
        """One MTP call for a whole step (before any sequence of it frees its pages): pairs for every committed
        token, so pages published to the prefix cache are complete for the MTP too, plus the first draft pair for
        sequences that just got a token, then the recursive drafts (with their q rows for sampled requests)."""
        jobs = []
        for it, (toks, _, kept), row in zip(batch, picks, out.cu):
            seq, st = it.seq, it.step
            k = 0
            if toks and seq.status == "running":
                p = seq.params
                k = num_drafts(self.proposer.k, len(seq.output) + len(toks), p.max_tokens,
                               len(seq.all_tokens) + len(toks), self.max_model_len)
                self.scheduler.grow(seq, st.start + kept + k)  # draft slots n .. n + k - 1 (n = tokens cached)
            job = make_job(seq.spec, seq.block_table, st.start, st.tokens[:kept], out.hidden[row:row + kept],
                           toks[-1] if k else None, k)
            if k and seq.params.temperature > 0:
                job.draw = draft_sampler(seq, toks)
            jobs.append(job)
        for it, job, drafts in zip(batch, jobs, self.proposer.run(jobs)):
            it.seq.spec.drafts, it.seq.spec.draft_q = drafts, job.q

    def eligible(self, batch: list[Scheduled]) -> bool:
        """True when every item of the step verifies all k drafts of a plain greedy request, no 64-token block
        boundary lies in (start, start + T + k] (no page or snapshot to publish, every draft slot in the current
        page) and the next step gets k drafts whatever the acceptance: the one-sync path's conditions on the
        requests (its shapes are checked by OneSyncStep)."""
        if self.one_sync is None or not self.runner.static_steps or not batch:
            return False
        k = self.one_sync.k
        T, bs = k + 1, self.block_size
        for it in batch:
            seq, st, p = it.seq, it.step, it.seq.params
            if (not st.spec or len(st.tokens) != T or it.publish or seq.status != "running" or not plain_greedy(p)
                    or (st.start + T + k) // bs != st.start // bs):
                return False
            if num_drafts(k, len(seq.output) + T, p.max_tokens, len(seq.all_tokens) + T, self.max_model_len) != k:
                return False
        return True

    def one_sync_step(self, batch: list[Scheduled]) -> list[list[int]] | None:
        """Run an eligible step on the device with one host read (k3.serve.spec_step) and do its bookkeeping (committed
        lengths, acceptance metrics, the next drafts and carried hidden); returns each sequence's emitted tokens, or
        None, having changed nothing but the pages reserved, when a shape is unavailable (the host path runs it)."""
        seqs, k = [it.step for it in batch], self.one_sync.k
        if self.one_sync.shapes(seqs) is None:
            return None
        T = k + 1
        for it in batch:  # draft slots up to start + 2k (kept = T); inside the current page (eligible)
            self.scheduler.grow(it.seq, it.step.start + 2 * k + 1)
        res = self.one_sync.run(seqs, [it.seq.spec.hidden for it in batch])
        if res is None:
            return None
        targets, kept, drafts, h_next = res
        emitted = []
        for n, it in enumerate(batch):
            seq, st = it.seq, it.step
            seq.num_computed = st.start + kept[n]
            self.output.acceptance(st.tokens[1:], kept[n] - 1)
            spec = seq.spec
            spec.hidden, spec.drafts, spec.draft_q, spec.verify_q = h_next[n], drafts[n * k:(n + 1) * k], [], None
            emitted.append(targets[n * T:n * T + kept[n]])
        return emitted
