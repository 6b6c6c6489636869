"""Engine: continuous batching over the hybrid caches of a K3 model (serving.md section 2).

Every `step()`:
1. takes new requests and aborts from a thread-safe inbox (the HTTP side never touches engine state);
2. the scheduler (k3.serve.scheduler) admits waiting sequences and returns the step's work;
3. the runner (k3.serve.runner) runs one forward over all of it;
4. the engine commits the results: verify steps keep their accepted prefix (the KDA state rolled back to it),
   newly completed pages and snapshots are published, new tokens are sampled and streamed (k3.serve.output), and
   with speculation the MTP catches up on the committed tokens and drafts the next k (k3.serve.proposer).
With `num_speculative_tokens` = k > 0 a decode step verifies the sequence's k MTP drafts in the same forward and
keeps the accepted prefix plus the bonus/resampled token (greedy match, or speculative sampling for temperature > 0;
k3.serve.verify); a step of plain greedy verifies takes the one-sync path (k3.serve.spec_step). Sequences join and
leave between any two steps. `start()` runs steps on a background thread; without it, call `step()` yourself
(tests, `k3 generate`).
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

from .config import ServeConfig
from .metrics import Metrics
from .output import OutputProcessor
from .pools import PagePool, SnapshotStore, StatePool
from .request import SamplingParams, SeqEvent, Sequence, TokenLogprob
from .runner import ModelRunner
from .sampling import greedy_picks, pick_token
from .scheduler import Scheduled, Scheduler
from .speculation import Speculation

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
        token_budget = cfg.max_num_batched_tokens or (2048 if dev.type == "cuda" else 256)
        if token_budget < bs:
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
        # with speculation the MTP's latent cache is one more page layer (k3.serve.proposer)
        self.pages = PagePool(n_mla + (1 if k else 0), num_pages, bs, mc.kv_lora_rank + mc.qk_rope_head_dim, dtype,
                              dev)
        self.states = StatePool(n_kda, cfg.max_num_seqs, mc.kda_num_heads, mc.kda_head_dim, mc.kda_conv_kernel,
                                dtype, dev, spec_tokens=k)
        self.snaps = (SnapshotStore(n_kda, cfg.num_state_snapshots, mc.kda_num_heads, mc.kda_head_dim,
                                    mc.kda_conv_kernel, dev, hidden_dim=mc.d_model if k else 0)
                      if cfg.enable_prefix_caching else None)
        self.runner = ModelRunner(model, self.pages, self.states, self.snaps, cfg, pages_per_seq)
        self.scheduler = Scheduler(self.pages, self.states, self.snaps, block_size=bs, token_budget=token_budget,
                                   max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
                                   metrics=self.metrics, graph_prefill=lambda: self.runner.graph_prefill)
        self.output = OutputProcessor(tokenizer, self.max_model_len, self.metrics)
        # MTP speculative decoding: drafts, acceptance, the one-sync step (k3.serve.speculation)
        self.spec = Speculation(self.runner, k, self.scheduler, self.output, self.snaps, self.max_model_len) if k \
            else None
        if self.spec is not None:
            self.scheduler.on_admit = self.spec.on_admit
        self.d_model, self.dtype, self.device = mc.d_model, dtype, dev
        self._inbox: deque = deque()
        self._cv = threading.Condition()
        self._num_queued = 0  # waiting + inbox submissions, for the bounded queue
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.dead: BaseException | None = None
        self.ready = False

    @property
    def waiting(self) -> deque[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def record_metrics(self) -> bool:
        return self.output.record_metrics

    @record_metrics.setter
    def record_metrics(self, on: bool) -> None:
        self.output.record_metrics = self.scheduler.record_metrics = on

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
            batches = self.cfg.cuda_graph_batches
            self.runner.capture_graphs(batches)  # CUDA graphs on: before /health is 200
            if self.spec is not None and self.spec.one_sync is not None:
                self.spec.one_sync.capture_common(batches)
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
                self.output.emit(s, "", [], None, "error", error=f"engine failure: {e!r}")

    def step(self) -> bool:
        """One scheduling iteration; returns False when there was nothing to run."""
        self._drain_inbox()
        self._expire()
        moved = self.scheduler.admit()
        if moved:
            with self._cv:
                self._num_queued -= moved
        sched = self.scheduler.schedule()
        self._gauges()
        if not sched.items:
            return False
        batch, n_tok = sched.items, sched.num_tokens
        if self._one_sync_step(batch, n_tok):  # all plain greedy verifies of k drafts: one host read
            self._gauges()
            return True
        with self._threads(n_tok):
            out = self.runner.step([it.step for it in batch])
            greedy = greedy_picks([(it.seq, it.step) for it in batch], out.logits)  # one argmax, one host read
        now = time.monotonic()
        if self.record_metrics:
            self.metrics.observe("k3:iteration_tokens_total", n_tok)
        # 1. commit what the caches now hold (verify steps: the accepted prefix), publish, pick the new tokens
        picks = []  # per batch item: (new tokens, their logprobs, tokens committed to the caches this step)
        for i, it in enumerate(batch):
            seq, st, publish = it.seq, it.step, it.publish
            toks, lps, kept = [], [], len(st.tokens)
            logits = out.logits[i]
            if st.spec:
                toks, lps = self.spec.verify_tokens(seq, st, logits)
                kept = len(toks)
                publish, snaps = self.scheduler.verify_publish(seq, st, kept, toks)
                self.runner.commit_spec(st, kept, snaps)
            seq.num_computed = st.start + kept
            self.scheduler.publish(publish)  # everything this step wrote is complete
            if seq.status == "running":
                if st.logits == "all" and seq.params.prompt_logprobs is not None:
                    self.output.prompt_logprobs(seq, st.start, len(st.tokens), logits)
                if not st.spec and not seq.prefilling and seq.params.max_tokens > 0:
                    tok, lp = (greedy[i], None) if i in greedy else pick_token(seq, logits[-1])
                    toks, lps = [tok], [lp]
            picks.append((toks, lps, kept))
        # 2. MTP: catch up on the committed tokens and draft the next ones (before any sequence frees its pages)
        if self.spec is not None:
            with self._threads(n_tok):  # the MTP catches up on the same tokens
                self.spec.draft(batch, picks, out)
        # 3. stream the new tokens (stop conditions may finish sequences here)
        for it, (toks, lps, _) in zip(batch, picks):
            seq = it.seq
            if seq.status != "running" or seq.prefilling:
                continue
            if seq.params.max_tokens == 0:  # prompt scoring only (echo + logprobs)
                self._finish(seq, "length")
                continue
            self._append_all(seq, toks, lps, now)
        self._gauges()
        return True

    def _append_all(self, seq: Sequence, toks: list[int], lps, now: float) -> None:
        """Stream a sequence's new tokens in order until one finishes it."""
        for tok, lp in zip(toks, lps):
            reason = self.output.append(seq, tok, lp, now)
            if reason is not None:
                self._finish(seq, reason, **({} if reason == "abort" else {"token": tok, "lp": lp}))
                return

    # ------------------------------------------------------------------------------------------------ speculation

    def _one_sync_step(self, batch: list[Scheduled], n_tok: int) -> bool:
        """Run the step on the one-sync path (k3.serve.speculation) when it qualifies; returns False, having changed
        nothing, when it does not (the host path runs it)."""
        if self.spec is None or not self.spec.eligible(batch):
            return False
        with self._threads(n_tok):
            emitted = self.spec.one_sync_step(batch)
        if emitted is None:
            return False
        now = time.monotonic()
        if self.record_metrics:
            self.metrics.observe("k3:iteration_tokens_total", n_tok)
        for it, toks in zip(batch, emitted):  # the host path's emit loop (stop conditions may finish sequences)
            self._append_all(it.seq, toks, [None] * len(toks), now)
        return True

    # ------------------------------------------------------------------------------------------------ queues

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

    def _finish(self, seq: Sequence, reason: str, *, token: int | None = None, lp: TokenLogprob | None = None,
                error: str | None = None) -> None:
        """Free the sequence's slot and pages at once and send its last event."""
        if seq.status == "running":
            self.scheduler.free(seq)
            seq.spec = None
        elif seq.status == "waiting":
            self.waiting.remove(seq)
            with self._cv:
                self._num_queued -= 1
        self.output.finished(seq, reason, token=token, lp=lp, error=error)

    def _gauges(self) -> None:
        self.output.gauges(len(self.running), len(self.waiting) + len(self._inbox), self.pages.usage(),
                           1.0 - len(self.states.free) / self.states.num_slots)

    # ------------------------------------------------------------------------------------------------ threads

    @contextlib.contextmanager
    def _threads(self, n_tokens: int):
        """CPU: `cpu_small_step_threads` intra-op threads for steps of <= 64 tokens (2 cores, k3-tiny, engine thread:
        waking a second thread per small op cost more than it saved; decode 50 -> 60, speculative 46 -> 74 tok/s)."""
        n, small = torch.get_num_threads(), self.cfg.cpu_small_step_threads
        if self.device.type != "cpu" or not small or n_tokens > 64:
            yield  # GPU steps and large CPU steps: nothing to change
            return
        torch.set_num_threads(min(small, n))
        try:
            yield
        finally:
            torch.set_num_threads(n)
