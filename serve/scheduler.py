"""The scheduler: which sequences run, from which cached prefix, with which tokens, each engine step (serving.md 2.1).

`schedule()` returns a `SchedulerOutput` (as vLLM's scheduler does): per scheduled sequence its `StepSeq` (tokens,
positions, slot, block table, logits wanted, snapshots to write) and what to publish to the prefix cache once the
step has run. The engine runs it and commits the results; the scheduler never calls the runner.

- Admission: FCFS while a KDA slot and enough latent pages are free; pages are reserved for the whole prompt +
  max_tokens, so a running sequence never runs out and no preemption is needed. With prefix caching a new sequence
  starts from the deepest block boundary whose latent pages AND KDA snapshot are cached (at least one prompt token is
  always computed: it produces the first logits).
- Each step: one decode token (plus its drafts to verify, with speculation) for every running sequence, then
  prefill chunks under the token budget `max_num_batched_tokens`; chunks are multiples of the 64-token block, so KDA
  chunk and page boundaries align; with graph prefill, short prompts come in graph-sized chunks
  (k3.serve.graphs.prefill_chunk).
- Publishing: full pages and their snapshots are published after the step that wrote them (written before
  published); a verify step's only after acceptance (`verify_publish`).

Legend: V vocab.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .graphs import GRAPH_PREFILL_MAX_TOKENS, prefill_chunk
from .metrics import Metrics
from .pools import PagePool, SnapshotStore, StatePool, block_hashes, chain_hash
from .request import Sequence
from .step import StepSeq


@dataclass(eq=False)
class Scheduled:
    """One scheduled sequence: its work and what to publish after the step, ("page" | "snap", hash, page/entry)."""

    seq: Sequence
    step: StepSeq
    publish: list = field(default_factory=list)


@dataclass
class SchedulerOutput:
    items: list[Scheduled]
    num_tokens: int  # new tokens of the step, all sequences


class Scheduler:
    """Waiting and running sequences over the engine's pools."""

    def __init__(self, pages: PagePool, states: StatePool, snaps: SnapshotStore | None, *, block_size: int,
                 token_budget: int, max_num_seqs: int, max_model_len: int, metrics: Metrics, graph_prefill):
        self.pages, self.states, self.snaps = pages, states, snaps
        self.block_size, self.token_budget, self.max_num_seqs = block_size, token_budget, max_num_seqs
        # graph_prefill() -> bool: short prompts come in graph-sized chunks (the runner's graphs are captured)
        self.max_model_len, self.metrics, self.graph_prefill = max_model_len, metrics, graph_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0  # pages promised to running sequences but not yet allocated
        self._reserve: dict[int, int] = {}
        self.record_metrics = True
        self.on_admit = None  # admit(seq, snapshot entry or None): the engine's per-sequence start (speculation)

    # ------------------------------------------------------------------------------------------------ admission

    def pages_needed(self, seq: Sequence) -> int:
        return math.ceil(min(len(seq.prompt) + seq.params.max_tokens, self.max_model_len) / self.block_size)

    def admit(self) -> int:
        """Move waiting sequences to running while slots and pages allow (FCFS). Returns how many left the queue."""
        moved = 0
        while self.waiting and len(self.running) < self.max_num_seqs and self.states.free:
            seq = self.waiting[0]
            hit_pages, entry = self.lookup_prefix(seq)
            for p in hit_pages:
                self.pages.acquire(p)
            need = self.pages_needed(seq) - len(hit_pages)
            if self.pages.num_free - self.reserved < need:
                self.pages.release(hit_pages)
                break  # FCFS: wait until running sequences free pages
            self.waiting.popleft()
            moved += 1
            seq.slot = self.states.allocate()
            seq.block_table = list(hit_pages)
            if hit_pages:
                self.snaps.read_into(entry, self.states, seq.slot)
                seq.num_computed = seq.num_cached = len(hit_pages) * self.block_size
            if self.on_admit is not None:
                self.on_admit(seq, entry if hit_pages else None)
            self._reserve[id(seq)] = need
            self.reserved += need
            seq.status, seq.t_scheduled = "running", time.monotonic()
            self.running.append(seq)
            if self.record_metrics:
                self.metrics.observe("k3:request_queue_time_seconds", seq.t_scheduled - seq.arrival)
                if self.snaps is not None:
                    self.metrics.inc("k3:prefix_cache_queries", len(seq.prompt))
                    self.metrics.inc("k3:prefix_cache_hits", seq.num_cached)
                    if hit_pages:
                        self.metrics.inc("k3:state_checkpoint_hits")
        return moved

    def lookup_prefix(self, seq: Sequence) -> tuple[list[int], int | None]:
        """Deepest cached prefix: (pages of blocks 0..k-1, snapshot entry after block k-1). At least one prompt
        token is always left to compute (it produces the first logits); prompt logprobs need the whole prompt."""
        if self.snaps is None or seq.params.prompt_logprobs is not None:
            return [], None
        nb = (len(seq.prompt) - 1) // self.block_size
        seq.hashes = block_hashes(seq.prompt, self.block_size, nb)
        k = 0
        while k < nb and self.pages.lookup(seq.hashes[k]) is not None:
            k += 1
        entry = None
        while k > 0 and (entry := self.snaps.find(seq.hashes[k - 1])) is None:
            k -= 1
        return [self.pages.lookup(h) for h in seq.hashes[:k]], entry

    def grow(self, seq: Sequence, end: int) -> None:
        """Extend the block table to cover positions [0, end) from the sequence's reserved pages."""
        while len(seq.block_table) * self.block_size < end:
            seq.block_table.append(self.pages.allocate())
            self._reserve[id(seq)] -= 1
            self.reserved -= 1

    def free(self, seq: Sequence) -> None:
        """Release a running sequence's slot, pages and page reservation at once."""
        self.running.remove(seq)
        self.states.release(seq.slot)
        self.pages.release(seq.block_table)
        self.reserved -= self._reserve.pop(id(seq), 0)
        seq.block_table = []

    def block_hash(self, seq: Sequence, block: int, toks: list[int] | None = None) -> bytes:
        """Chained hash of block `block` of the sequence's tokens (extends seq.hashes as tokens become known);
        `toks` overrides seq.all_tokens when tokens are known before they are appended."""
        toks = seq.all_tokens if toks is None else toks
        bs = self.block_size
        while len(seq.hashes) <= block:
            b = len(seq.hashes)
            seq.hashes.append(chain_hash(seq.hashes[-1] if seq.hashes else b"", toks[b * bs:(b + 1) * bs]))
        return seq.hashes[block]

    # ------------------------------------------------------------------------------------------------ the step

    def schedule(self) -> SchedulerOutput:
        """The next step's work: decodes (and verifies) first, then prefill chunks, under the token budget."""
        budget, bs = self.token_budget, self.block_size
        items = []
        decodes = [s for s in self.running if not s.prefilling]
        prefills = [s for s in self.running if s.prefilling]
        for seq in decodes + prefills:
            if budget <= 0:
                break
            start = seq.num_computed
            if pre := start < len(seq.prompt):
                rem = len(seq.prompt) - start
                take = rem if rem <= budget else (budget // bs) * bs
                if self.graph_prefill() and rem <= GRAPH_PREFILL_MAX_TOKENS and seq.params.prompt_logprobs is None:
                    take = prefill_chunk(take, bs)  # warmed graph lengths; never across a block (prompt logprobs: eager)
                if take <= 0:
                    continue
                tokens = seq.prompt[start:start + take]
                last = start + take == len(seq.prompt)
                mode = "all" if seq.params.prompt_logprobs is not None else ("last" if last else "none")
            else:
                tokens, mode = [seq.output[-1]], "last"
                spec = seq.spec
                if spec is not None and spec.drafts:  # verify the drafts that fit the budget in one forward
                    tokens += spec.drafts[:budget - 1]
                    mode = "all" if len(tokens) > 1 else mode
                    if spec.draft_q and len(tokens) > 1:
                        spec.verify_q = torch.stack(spec.draft_q[:len(tokens) - 1])  # [K, V]
                    spec.drafts, spec.draft_q = [], []
            budget -= len(tokens)
            end = start + len(tokens)
            if len(seq.block_table) * bs < end:
                self.grow(seq, end)
            st = StepSeq(tokens=tokens, start=start, slot=seq.slot, block_table=seq.block_table, logits=mode,
                         spec=len(tokens) > 1 and not pre)
            item = Scheduled(seq, st)  # (a verify step's pages and snapshots are published after acceptance)
            if self.snaps is not None and not st.spec and (first := (start // bs + 1) * bs) <= end:
                for p in range(first, end + 1, bs):  # block boundaries in (start, end]
                    h = self.block_hash(seq, p // bs - 1)
                    item.publish.append(("page", h, seq.block_table[p // bs - 1]))
                    if p == end or start % bs == 0:  # a state the kernels expose there (k3.serve.cache)
                        entry = self.snaps.reserve(h)
                        if entry is not None:
                            st.snapshots.append((p, entry))
                            item.publish.append(("snap", h, entry))
            items.append(item)
        if self.snaps is not None and self.record_metrics:
            self.metrics.set("k3:state_checkpoint_evictions", self.snaps.evictions)
        return SchedulerOutput(items, sum(len(it.step.tokens) for it in items))

    def verify_publish(self, seq: Sequence, st: StepSeq, kept: int, toks: list[int]) -> tuple[list, list]:
        """After a verify step that kept `kept` tokens (toks: the emitted ones, not appended yet): the pages and
        snapshots to publish at the block boundaries among the kept tokens, and the snapshots (boundary, entry) the
        runner must write from its per-token states first."""
        bs, start = self.block_size, st.start
        known = seq.all_tokens + toks[:kept - 1]  # accepted drafts are not in seq.output yet
        publish, snaps = [], []
        if self.snaps is not None:
            for p in range((start // bs + 1) * bs, start + kept + 1, bs):
                h = self.block_hash(seq, p // bs - 1, known)
                publish.append(("page", h, seq.block_table[p // bs - 1]))
                entry = self.snaps.reserve(h)
                if entry is not None:
                    snaps.append((p, entry))
                    publish.append(("snap", h, entry))
        return publish, snaps

    def publish(self, items: list) -> None:
        """Everything a step wrote is complete: publish its pages and snapshots."""
        for kind, h, ref in items:
            if kind == "page":
                self.pages.register(ref, h)
            else:
                self.snaps.publish(h, ref)
