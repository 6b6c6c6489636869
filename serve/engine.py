"""Engine: continuous batching over the hybrid caches of a K3 model (serving.md section 2).

Every `step()`:
1. takes new requests and aborts from a thread-safe inbox (the HTTP side never touches engine state);
2. admits waiting sequences FCFS while a KDA slot and enough latent pages are free (pages are reserved for the
   whole prompt + max_tokens, so a running sequence never runs out and no preemption is needed); with prefix
   caching a new sequence starts from the deepest block boundary whose latent pages AND KDA snapshot are cached;
3. schedules one decode token for every running sequence, then prefill chunks under the token budget
   `max_num_batched_tokens` (chunks are multiples of the 64-token block, so KDA chunk and page boundaries align);
4. runs one forward (`ModelRunner`), publishes newly completed pages and snapshots (written before published),
   samples, detokenizes, applies stop conditions and sends a `SeqEvent` to each sequence's sink.
With `num_speculative_tokens` = k > 0 (k3.serve.speculative), a decode step verifies the sequence's k MTP drafts
in the same forward, keeps the accepted prefix plus the bonus/resampled token (greedy match, or speculative
sampling for temperature > 0), rolling the KDA state back to it, and the MTP then catches up on the committed
tokens and drafts the next k. Sequences join and leave between any two steps. `start()` runs steps on a background
thread; without it, call `step()` yourself (tests, `k3 generate`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections import deque

import torch

from k3.model.tokenizer import IncrementalDecoder, K3Tokenizer
from k3.model.transformer import K3Model

from .cache import PagePool, SnapshotStore, StatePool, block_hashes, chain_hash
from .config import ServeConfig
from .metrics import Metrics
from .request import SamplingParams, SeqEvent, Sequence, TokenLogprob, token_logprob
from .runner import ModelRunner, StepSeq
from .sampling import apply_penalties, greedy_picks, sample, token_probs
from .spec_fast import fast_spec_step
from .speculative import MTPDrafter, SpecState, verify_tokens
from .tail_graphs import GRAPH_PREFILL_MAX_TOKENS, prefill_chunk  # graph prefill: 64-token chunks, then powers of two

DEFAULT_MAX_MODEL_LEN = 2048


class QueueFull(RuntimeError):
    """The waiting queue holds max_queue requests (HTTP 503 queue_full)."""


class EngineDead(RuntimeError):
    """The engine thread stopped after an internal error (HTTP 503; /health turns non-200)."""


class Engine:
    """Continuous-batching engine. submit() / abort() are thread-safe; step() runs on one thread only."""

    def __init__(self, model: K3Model, tokenizer: K3Tokenizer, cfg: ServeConfig, metrics: Metrics | None = None):
        mc = model.config
        self.model, self.tok, self.cfg = model.eval(), tokenizer, cfg
        self.metrics = metrics or Metrics(cfg.served_model_name or "k3")
        self.max_model_len = cfg.max_model_len or DEFAULT_MAX_MODEL_LEN
        bs = self.block_size = cfg.kv_block_size
        if bs % mc.kda_chunk_size or bs < 16:
            raise ValueError(f"kv_block_size={bs} must be a multiple of the KDA chunk size {mc.kda_chunk_size} so "
                             "snapshots land on chunk boundaries (kda.md 8); use 64")
        dev = next(model.parameters()).device
        self.token_budget = cfg.max_num_batched_tokens or (2048 if dev.type == "cuda" else 256)
        if self.token_budget < bs:
            raise ValueError(f"max_num_batched_tokens={cfg.max_num_batched_tokens} must be >= kv_block_size={bs} "
                             "(prefill chunks are whole blocks)")
        if cfg.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {cfg.max_num_seqs}")
        pages_per_seq = math.ceil(self.max_model_len / bs)
        num_pages = cfg.num_kv_blocks or cfg.max_num_seqs * pages_per_seq * (2 if cfg.enable_prefix_caching else 1)
        if num_pages < pages_per_seq:
            raise ValueError(f"num_kv_blocks={num_pages} cannot hold one sequence of max_model_len="
                             f"{self.max_model_len} ({pages_per_seq} pages of {bs}); raise it or lower max_model_len")
        dtype = next(model.parameters()).dtype
        k = cfg.num_speculative_tokens
        if k < 0 or k > 16:
            raise ValueError(f"num_speculative_tokens must be in [0, 16], got {k} (1-3 is typical for one MTP head)")
        if k and model.mtp is None:
            raise ValueError("num_speculative_tokens > 0 needs a checkpoint with an MTP head (model.mtp_depth: 1); "
                             "serve this one without --speculative-tokens")
        n_kda = mc.layer_types.count("kda")
        n_mla = len(mc.layer_types) - n_kda
        # with speculation the MTP's latent cache is one more page layer (k3.serve.speculative)
        self.pages = PagePool(n_mla + (1 if k else 0), num_pages, bs, mc.kv_lora_rank + mc.qk_rope_head_dim, dtype,
                              dev)
        self.states = StatePool(n_kda, cfg.max_num_seqs, mc.kda_num_heads, mc.kda_head_dim, mc.kda_conv_kernel,
                                dtype, dev, spec_tokens=k)
        self.snaps = (SnapshotStore(n_kda, cfg.num_state_snapshots, mc.kda_num_heads, mc.kda_head_dim,
                                    mc.kda_conv_kernel, dev, hidden_dim=mc.d_model if k else 0)
                      if cfg.enable_prefix_caching else None)
        self.runner = ModelRunner(model, self.pages, self.states, self.snaps, cfg, pages_per_seq)
        self.drafter = MTPDrafter(self.runner, k) if k else None
        self._spec: dict[int, SpecState] = {}  # id(seq) -> drafting state (speculation on)
        self.d_model, self.dtype = mc.d_model, dtype
        self.device = dev
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._inbox: deque = deque()
        self._cv = threading.Condition()
        self._num_queued = 0  # waiting + inbox submissions, for the bounded queue
        self._reserved = 0  # pages promised to running sequences but not yet allocated
        self._reserve: dict[int, int] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.dead: BaseException | None = None
        self.ready = False
        self.record_metrics = True
        self.spec_fast = self.spec_fused = True  # spec_fast.py: one-sync greedy spec steps, post-verify as one graph
        self._n_gen, self._itl = 0, []  # this step's generated tokens and inter-token latencies (metrics)

    # ------------------------------------------------------------------------------------------------ public API

    def submit(self, prompt: list[int], params: SamplingParams, sink, *, n: int = 1,
               request_id: str | None = None) -> list[str]:
        """Queue `n` sequences of one prompt; `sink(SeqEvent)` is called from the engine thread. Returns seq ids.

        Raises QueueFull when max_queue requests already wait, EngineDead after an engine failure, ValueError for
        prompts the engine cannot hold (the HTTP layer validates first and answers 400)."""
        if self.dead is not None:
            raise EngineDead(f"engine stopped: {self.dead!r}")
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len {self.max_model_len}")
        rid = request_id or f"req-{next(self._ids)}"
        seqs = []
        for i in range(n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed((params.seed + i) % (1 << 63))
            seqs.append(Sequence(seq_id=f"{rid}-{i}", index=i, prompt=list(prompt), params=params, sink=sink,
                                 decoder=IncrementalDecoder(self.tok, skip_special_tokens=params.skip_special_tokens),
                                 generator=gen))
        with self._cv:
            if self._num_queued + n > self.cfg.max_queue:
                raise QueueFull(f"{self._num_queued} requests are waiting (max_queue {self.cfg.max_queue})")
            self._num_queued += n
            self._inbox.extend(("add", s) for s in seqs)
            self._cv.notify()
        return [s.seq_id for s in seqs]

    def abort(self, seq_ids: list[str]) -> None:
        """Cancel sequences (client gone): their slot and pages are freed at the next step."""
        with self._cv:
            self._inbox.extend(("abort", sid) for sid in seq_ids)
            self._cv.notify()

    def abort_all(self) -> None:
        """Cancel every waiting and running sequence at the next step (end of a graceful shutdown)."""
        with self._cv:
            self._inbox.append(("abort_all", None))
            self._cv.notify()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inbox)

    def start(self) -> None:
        """Run steps on a daemon thread until stop()."""
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def generate(self, prompt: list[int], params: SamplingParams, n: int = 1) -> list[list[SeqEvent]]:
        """Blocking helper: all events of the `n` sequences of one prompt, by choice index."""
        events: list[list[SeqEvent]] = [[] for _ in range(n)]
        done = threading.Event()
        left = [n]

        def sink(ev: SeqEvent) -> None:
            events[ev.index].append(ev)
            if ev.finish_reason is not None:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        self.submit(prompt, params, sink, n=n)
        if self._thread is None:
            while not done.is_set():
                self.step()
        else:
            done.wait()
        return events

    def warmup(self) -> None:
        """Run every step shape once (short and chunked prefill, batched decode, snapshot paths), then forget the
        warmup's cache entries; sets `ready`."""
        self.record_metrics = False
        try:
            greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            sampled = SamplingParams(temperature=1.0, top_p=0.9, top_k=5, min_p=0.01, max_tokens=2, seed=0,
                                     ignore_eos=True, logprobs=2, presence_penalty=0.5, prompt_logprobs=1)
            L = min(self.block_size + 3, self.max_model_len - 4)
            bos = self.tok.bos_id
            # first: a shape the generate calls below meet would be captured plain (uncompiled, k3.serve.graphs)
            self.runner.capture_decode_graphs(self.cfg.cuda_graph_batches)  # CUDA graphs on: before /health is 200
            for prompt, p in (([bos] * 3, greedy), ([bos] * L, greedy), ([bos] * L, sampled)):
                self.generate(prompt, p, n=2)
            self.reset_prefix_cache()
        finally:
            self.record_metrics = True
        self.ready = True

    def reset_prefix_cache(self) -> None:
        self.pages.reset_prefix_cache()
        if self.snaps is not None:
            self.snaps.clear()

    # ------------------------------------------------------------------------------------------------ loop

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stop and not self.has_work():
                        self._cv.wait(timeout=1.0)
                    if self._stop:
                        return
                self.step()
        except BaseException as e:  # noqa: BLE001 - the engine must report, not vanish
            self.dead = e
            for s in list(self.running) + list(self.waiting):
                self._emit(s, "", [], None, "error", error=f"engine failure: {e!r}")

    def step(self) -> bool:
        """One scheduling iteration; returns False when there was nothing to run."""
        self._drain_inbox()
        self._expire()
        self._admit()
        batch = self._schedule()
        self._gauges()
        if not batch:
            return False
        n_tok = sum(len(st.tokens) for _, st, _ in batch)
        if self.spec_fast and fast_spec_step(self, batch, n_tok):  # all-greedy full-draft verify: one host read
            self._gauges()
            return True
        with self._threads(n_tok):
            out = self.runner.step([st for _, st, _ in batch])
            greedy = greedy_picks([(seq, st) for seq, st, _ in batch], out.logits)  # one argmax, one host read
        now = time.monotonic()
        if self.record_metrics:
            self.metrics.observe("k3:iteration_tokens_total", n_tok)
        # 1. commit what the caches now hold (verify steps: the accepted prefix), publish, pick the new tokens
        picks = []  # per batch item: (new tokens, their logprobs, tokens committed to the caches this step)
        for i, (seq, st, publish) in enumerate(batch):
            toks, lps, kept = [], [], len(st.tokens)
            logits = out.logits[i]
            if st.spec:
                toks, lps = verify_tokens(self, seq, st, logits)
                kept = len(toks)
                publish = self._commit_verify(i, seq, st, kept, toks)
            seq.num_computed = st.start + kept
            for kind, h, ref in publish:  # everything this step wrote is complete: publish pages and snapshots
                if kind == "page":
                    self.pages.register(ref, h)
                else:
                    self.snaps.publish(h, ref)
            if seq.status == "running":
                if st.logits == "all" and seq.params.prompt_logprobs is not None:
                    self._gather_prompt_logprobs(seq, st, logits)
                if not st.spec and not seq.prefilling and seq.params.max_tokens > 0:
                    tok, lp = (greedy[i], None) if i in greedy else self._sample(seq, logits[-1])
                    toks, lps = [tok], [lp]
            picks.append((toks, lps, kept))
        # 2. MTP: catch up on the committed tokens and draft the next ones (before any sequence frees its pages)
        if self.drafter is not None:
            with self._threads(n_tok):  # the MTP catches up on the same tokens
                self.drafter.after_step(self, batch, picks, out)
        # 3. stream the new tokens (stop conditions may finish sequences here)
        for (seq, st, _), (toks, lps, _) in zip(batch, picks):
            if seq.status != "running" or seq.prefilling:
                continue
            if seq.params.max_tokens == 0:  # prompt scoring only (echo + logprobs)
                self._finish(seq, "length")
                continue
            for tok, lp in zip(toks, lps):
                self._append(seq, tok, lp, now)
                if seq.status != "running":
                    break
        self._gauges()
        return True

    # ------------------------------------------------------------------------------------------------ speculation

    def _commit_verify(self, i: int, seq: Sequence, st: StepSeq, kept: int, toks: list[int]) -> list:
        """Roll the verify step of batch item i back to its first `kept` tokens; returns the pages and snapshots
        to publish (block boundaries among the kept tokens, whose per-token KDA states the runner still holds)."""
        bs, start = self.block_size, st.start
        known = seq.all_tokens + toks[:kept - 1]  # accepted drafts are not in seq.output yet
        publish, snaps = [], []
        if self.snaps is not None:
            for p in range((start // bs + 1) * bs, start + kept + 1, bs):
                h = self._hash(seq, p // bs - 1, known)
                publish.append(("page", h, seq.block_table[p // bs - 1]))
                entry = self.snaps.reserve(h)
                if entry is not None:
                    snaps.append((p, entry))
                    publish.append(("snap", h, entry))
        self.runner.commit_spec(i, kept, snaps)
        return publish

    # ------------------------------------------------------------------------------------------------ scheduling

    def _drain_inbox(self) -> None:
        with self._cv:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, x in items:
            if kind == "add":
                self.waiting.append(x)
            elif kind == "abort_all":
                for s in list(self.waiting) + list(self.running):
                    self._finish(s, "abort")
            else:
                for s in itertools.chain(self.waiting, self.running):
                    if s.seq_id == x and s.status != "finished":
                        self._finish(s, "abort")
                        break

    def _expire(self) -> None:
        limit = self.cfg.request_timeout_s
        now = time.monotonic()
        for s in list(self.running) + list(self.waiting):
            if limit and now - s.arrival > limit:
                self._finish(s, "abort", error=f"request exceeded request_timeout_s={limit}")

    def _pages_needed(self, seq: Sequence) -> int:
        return math.ceil(min(len(seq.prompt) + seq.params.max_tokens, self.max_model_len) / self.block_size)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_num_seqs and self.states.free:
            seq = self.waiting[0]
            hit_pages, entry = self._lookup_prefix(seq)
            for p in hit_pages:
                self.pages.acquire(p)
            need = self._pages_needed(seq) - len(hit_pages)
            if self.pages.num_free - self._reserved < need:
                self.pages.release(hit_pages)
                return  # FCFS: wait until running sequences free pages
            self.waiting.popleft()
            with self._cv:
                self._num_queued -= 1
            seq.slot = self.states.allocate()
            seq.block_table = list(hit_pages)
            if self.drafter is not None:
                self._spec[id(seq)] = SpecState(hidden=torch.zeros(self.d_model, device=self.device))
            if hit_pages:
                self.snaps.read_into(entry, self.states, seq.slot)
                seq.num_computed = seq.num_cached = len(hit_pages) * self.block_size
                if self.drafter is not None:  # h_{p-1} pairs with token p in the MTP
                    self._spec[id(seq)].hidden = self.snaps.read_hidden(entry)
            self._reserve[id(seq)] = need
            self._reserved += need
            seq.status, seq.t_scheduled = "running", time.monotonic()
            self.running.append(seq)
            if self.record_metrics:
                self.metrics.observe("k3:request_queue_time_seconds", seq.t_scheduled - seq.arrival)
                if self.snaps is not None:
                    self.metrics.inc("k3:prefix_cache_queries", len(seq.prompt))
                    self.metrics.inc("k3:prefix_cache_hits", seq.num_cached)
                    if hit_pages:
                        self.metrics.inc("k3:state_checkpoint_hits")

    def _lookup_prefix(self, seq: Sequence) -> tuple[list[int], int | None]:
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

    def _grow(self, seq: Sequence, end: int) -> None:
        """Extend the block table to cover positions [0, end) from the sequence's reserved pages."""
        while len(seq.block_table) * self.block_size < end:
            seq.block_table.append(self.pages.allocate())
            self._reserve[id(seq)] -= 1
            self._reserved -= 1

    def _hash(self, seq: Sequence, block: int, toks: list[int] | None = None) -> bytes:
        """Chained hash of block `block` of the sequence's tokens (extends seq.hashes as tokens become known);
        `toks` overrides seq.all_tokens when tokens are known before they are appended."""
        toks = seq.all_tokens if toks is None else toks
        bs = self.block_size
        while len(seq.hashes) <= block:
            b = len(seq.hashes)
            seq.hashes.append(chain_hash(seq.hashes[-1] if seq.hashes else b"", toks[b * bs:(b + 1) * bs]))
        return seq.hashes[block]

    def _schedule(self) -> list[tuple[Sequence, StepSeq, list]]:
        budget = self.token_budget
        bs = self.block_size
        batch = []
        decodes, prefills = [], []
        for s in self.running:
            (prefills if s.prefilling else decodes).append(s)
        for seq in decodes + prefills:
            if budget <= 0:
                break
            start = seq.num_computed
            if pre := start < len(seq.prompt):
                rem = len(seq.prompt) - start
                take = rem if rem <= budget else (budget // bs) * bs
                if self.runner.graph_prefill and rem <= GRAPH_PREFILL_MAX_TOKENS and seq.params.prompt_logprobs is None:
                    take = prefill_chunk(take, bs)  # warmed graph lengths; never across a block (prompt logprobs: eager)
                if take <= 0:
                    continue
                tokens = seq.prompt[start:start + take]
                last = start + take == len(seq.prompt)
                mode = "all" if seq.params.prompt_logprobs is not None else ("last" if last else "none")
            else:
                tokens, mode = [seq.output[-1]], "last"
                spec = self._spec.get(id(seq)) if self._spec else None
                if spec is not None and spec.drafts:  # verify the drafts that fit the budget in one forward
                    tokens += spec.drafts[:budget - 1]
                    mode = "all" if len(tokens) > 1 else mode
                    if spec.draft_q and len(tokens) > 1:
                        spec.verify_q = torch.stack(spec.draft_q[:len(tokens) - 1])  # [K, V]
                    spec.drafts, spec.draft_q = [], []
            budget -= len(tokens)
            end = start + len(tokens)
            if len(seq.block_table) * bs < end:
                self._grow(seq, end)
            st = StepSeq(tokens=tokens, start=start, slot=seq.slot, block_table=seq.block_table, logits=mode,
                         spec=len(tokens) > 1 and not pre)
            publish = []  # (a verify step's pages and snapshots are published after acceptance: _commit_verify)
            if self.snaps is not None and not st.spec and (first := (start // bs + 1) * bs) <= end:
                for p in range(first, end + 1, bs):  # block boundaries in (start, end]
                    h = self._hash(seq, p // bs - 1)
                    publish.append(("page", h, seq.block_table[p // bs - 1]))
                    if p == end or start % bs == 0:  # a state the kernels expose there (serve/prefill.py)
                        entry = self.snaps.reserve(h)
                        if entry is not None:
                            st.snapshots.append((p, entry))
                            publish.append(("snap", h, entry))
            batch.append((seq, st, publish))
        if self.snaps is not None and self.record_metrics:
            self.metrics.set("k3:state_checkpoint_evictions", self.snaps.evictions)
        return batch

    # ------------------------------------------------------------------------------------------------ sampling

    @contextlib.contextmanager
    def _threads(self, n_tokens: int):
        """CPU: `cpu_small_step_threads` intra-op threads for steps of <= 64 tokens (2 cores, k3-tiny, engine thread:
        waking a second thread per small op cost more than it saved; decode 50 -> 60, speculative 46 -> 74 tok/s)."""
        n, small = torch.get_num_threads(), self.cfg.cpu_small_step_threads
        if self.runner.device.type != "cpu" or not small or n_tokens > 64:
            yield  # GPU steps and large CPU steps: nothing to change
            return
        torch.set_num_threads(min(small, n))
        try:
            yield
        finally:
            torch.set_num_threads(n)

    def _sample(self, seq: Sequence, row_V: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """Next token from fp32 logits [V]; logprobs are the model's raw log-softmax (before penalties and
        temperature, vLLM's default)."""
        p = seq.params
        logits = apply_penalties(row_V, p, seq.counts, seq.prompt)
        tok = int(sample(logits[None], temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                         generator=seq.generator)[0])
        return tok, self._logprob(seq, row_V, tok)

    def _logprob(self, seq: Sequence, row_V: torch.Tensor, tok: int) -> TokenLogprob | None:
        k = seq.params.logprobs
        return None if k is None else token_logprob(torch.log_softmax(row_V.float(), -1), tok, k)

    def _probs(self, seq: Sequence, row_V: torch.Tensor, counts: dict[int, int]) -> torch.Tensor:
        """The weights [V] a sampled request draws from after `counts` generated tokens (penalties included)."""
        p = seq.params
        logits = apply_penalties(row_V, p, counts, seq.prompt)
        return token_probs(logits[None], temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p)[0]

    def draft_sampler(self, seq: Sequence, new_tokens: list[int]):
        """The MTP draw function of a sampled sequence whose step just produced `new_tokens` (not yet appended):
        draft r is drawn from q = the request's processed distribution of the MTP logits, with penalties counting
        the output so far, `new_tokens` and drafts 1..r-1, i.e. exactly what the target sees at that position."""
        counts = dict(seq.counts)
        for t in new_tokens:
            counts[t] = counts.get(t, 0) + 1

        def draw(logits_V: torch.Tensor) -> tuple[int, torch.Tensor]:
            q_V = self._probs(seq, logits_V.float(), counts)
            tok = int(torch.multinomial(q_V, 1, generator=seq.generator))
            counts[tok] = counts.get(tok, 0) + 1
            return tok, q_V

        return draw

    def _gather_prompt_logprobs(self, seq: Sequence, st: StepSeq, logits_TV: torch.Tensor) -> None:
        """Row j of the chunk predicts prompt token start + j + 1."""
        if st.start == 0:
            seq.prompt_lp.append(None)
        lsm = torch.log_softmax(logits_TV.float(), -1)
        for j in range(len(st.tokens)):
            i = st.start + j + 1
            if i < len(seq.prompt):
                seq.prompt_lp.append(token_logprob(lsm[j], seq.prompt[i], seq.params.prompt_logprobs))

    def _append(self, seq: Sequence, tok: int, lp: TokenLogprob | None, now: float) -> None:
        p = seq.params
        seq.output.append(tok)
        seq.counts[tok] = seq.counts.get(tok, 0) + 1
        if self.record_metrics:  # generation_tokens and the ITLs go to the registry once per step (_gauges)
            if seq.t_first is None:
                self.metrics.observe("k3:time_to_first_token_seconds", now - seq.arrival)
            else:
                self._itl.append(now - seq.t_last)
            self._n_gen += 1
        if seq.t_first is None:
            seq.t_first = now
        seq.t_last = now
        finish = seq.add_text(tok, self.tok.eos_id)
        n_out = len(seq.output)
        if finish is None and (n_out >= p.max_tokens or len(seq.prompt) + n_out >= self.max_model_len):
            finish = "length"
        if finish is not None:
            if finish == "length":
                seq.text += seq.decoder.flush()  # an incomplete trailing character becomes U+FFFD
            self._finish(seq, finish, token=tok, lp=lp)
            return
        self._emit(seq, seq.take_delta(), [tok], [lp] if lp is not None else None, None)

    # ------------------------------------------------------------------------------------------------ finishing

    def _finish(self, seq: Sequence, reason: str, *, token: int | None = None, lp: TokenLogprob | None = None,
                error: str | None = None) -> None:
        """Free the sequence's slot and pages at once and send its last event."""
        if seq.status == "running":
            self.running.remove(seq)
            self.states.release(seq.slot)
            self.pages.release(seq.block_table)
            self._reserved -= self._reserve.pop(id(seq), 0)
            self._spec.pop(id(seq), None)
            seq.block_table = []
        elif seq.status == "waiting":
            self.waiting.remove(seq)
            with self._cv:
                self._num_queued -= 1
        seq.status, seq.finish_reason = "finished", reason
        delta = seq.text[seq.emitted:]
        seq.emitted = len(seq.text)
        now = time.monotonic()
        if self.record_metrics:
            self.metrics.inc("k3:request_success", finished_reason=reason)
            self.metrics.observe("k3:e2e_request_latency_seconds", now - seq.arrival)
            self.metrics.observe("k3:request_prompt_tokens", len(seq.prompt))
            self.metrics.observe("k3:request_generation_tokens", len(seq.output))
            self.metrics.inc("k3:prompt_tokens", max(0, min(seq.num_computed, len(seq.prompt)) - seq.num_cached))
            if seq.t_first is not None and seq.t_scheduled is not None:
                self.metrics.observe("k3:request_prefill_time_seconds", seq.t_first - seq.t_scheduled)
                self.metrics.observe("k3:request_decode_time_seconds", now - seq.t_first)
        self._emit(seq, delta, [] if token is None else [token], None if lp is None else [lp], reason, error=error)

    def _emit(self, seq: Sequence, text: str, toks: list[int], lps, finish: str | None, error: str | None = None):
        ev = SeqEvent(seq_id=seq.seq_id, index=seq.index, text=text, token_ids=toks, logprobs=lps,
                      finish_reason=finish, num_prompt_tokens=len(seq.prompt), num_cached_tokens=seq.num_cached,
                      num_output_tokens=len(seq.output), error=error)
        if not seq.sent_first:
            seq.sent_first = True
            if seq.params.prompt_logprobs is not None:
                ev.prompt_logprobs = seq.prompt_lp
        try:
            seq.sink(ev)
        except Exception:  # noqa: BLE001 - a broken client sink must not stop the engine
            if finish is None:
                self._finish(seq, "abort")

    def _gauges(self) -> None:
        if not self.record_metrics:
            return
        m = self.metrics
        if self._n_gen:  # the step's per-token series: one registry call each, not two per token
            m.inc("k3:generation_tokens", self._n_gen)
            m.observe_many("k3:inter_token_latency_seconds", self._itl)
            self._n_gen, self._itl = 0, []
        m.set("k3:num_requests_running", len(self.running))
        m.set("k3:num_requests_waiting", len(self.waiting) + len(self._inbox))
        m.set("k3:kv_cache_usage_perc", self.pages.usage())
        m.set("k3:kda_state_slots_usage_perc", 1.0 - len(self.states.free) / self.states.num_slots)
