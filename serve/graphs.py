"""The graph runner: every fixed-shape step of k3.serve.static, keyed by (kind, batch bucket, tokens per row, page
bucket), captured in CUDA graphs on first use and replayed (serving.md 2.5: "Decode runs as whole-step CUDA graphs
per batch-size bucket"). Without capture (the CPU) the same functions run eagerly on the same buffers.

Kinds: "step" (T = 1 decode, T = 2..64 prefill chunks), "verify" (T = 1 + drafts), "mtp" (1..k + 2 pairs), each
verify shape's rollback, and functions other layers register (k3.serve.spec_step's post-verify function).

Shapes. Batch buckets Bb = 1, 2, 4, 8, ... capped at max_num_seqs (the state pool's slots). Page buckets Gb = 1, 2,
4, ... capped at the pages of one sequence at max_model_len, on the PyTorch attention path; with the Triton paged
kernel, which reads keys up to each row's position only, one width (max pages) serves every step (`page_bucket`).
At most `max_graphs` graphs are captured in all (beyond: eager on the buffers), prefill chunks of lengths other
than CHUNK_LENGTHS at most `max_tail_graphs` of them (captured on first use, never compiled: up to 63 lengths per
bucket would fill the cap and leave decode, verify and MTP shapes met later eager for good). A shape whose capture
raised runs eagerly from then on (one warning naming the reason).

torch.compile (`compile`): decode (T = 1) and verify shapes only, and only those the warm-up captures
(`capture_common`): a shape first met while serving is captured from the plain function, so no request waits for a
minute-long compile; a step whose own bucket is not compiled runs on the smallest larger compiled bucket of its
shape (padded rows are inert): on an H200 k3-small's compiled batch-32 decode step took ~4.2 ms, its plain batch-1
graph 7.1 ms, so 5 streams run faster padded to 32.

Memory: graphs share one pool (they replay one at a time on the engine thread) and each keeps its static outputs:
any graph's logits cost 128 KiB per row for k3-small, so even 128 graphs stay near 1 GiB at worst.

Legend: B sequences, Bb batch bucket, T tokens per row, Gb page bucket, D width, V_ vocab.
"""

from __future__ import annotations

import logging
import time

import torch

from k3.model.kda import RECURRENT_MAX_TOKENS
from k3.model.mla import paged_attention_bounded

from .cache import ends_at_step_end, write_step_end_snapshots
from .static import (
    MTPBuffers,
    StaticBuffers,
    StepBuffers,
    commit_forward,
    commit_inert,
    commit_layout,
    fill_inert,
    mtp_forward,
    mtp_layout,
    step_forward,
    step_layout,
)
from .step import StepOutput, StepSeq, VerifyRecord

log = logging.getLogger("k3.serve")

# The default warm-up (batches 1, 8, 32) alone captures 6 decode + 36 prefill-chunk graphs, with k speculative
# tokens 3 verify + 3 (k + 2) MTP + 3 post-verify more (66 at k = 4): 64 left no room for the shapes met later.
MAX_GRAPHS = 128
MAX_TAIL_GRAPHS = 16  # prefill-chunk graphs of lengths outside CHUNK_LENGTHS, within MAX_GRAPHS
COMMON_BATCHES = (1, 8, 32)  # the warm-up's default batches (the engine passes ServeConfig.cuda_graph_batches)
WARMUP_RUNS = 2  # eager runs on a side stream before a capture (lazy inits, Triton compilation, MoE probe)
GRAPH_PREFILL_MAX_TOKENS = 512  # with graph prefill, prompts (or rests) up to this length prefill in graph chunks
CHUNK_LENGTHS = tuple(1 << e for e in range(1, RECURRENT_MAX_TOKENS.bit_length()))  # 2, 4, ..., 64


def bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n, capped at `cap` (n <= cap). Example: bucket(5, 64) -> 8; bucket(5, 6) -> 6."""
    b = 1
    while b < n:
        b *= 2
    return min(b, cap)


def warm_buckets(batches, cap: int) -> list[int]:
    """Every batch bucket up to the largest of `batches` (capped at `cap`). Example: warm_buckets([1, 8, 32], 64) ->
    [1, 2, 4, 8, 16, 32]; warm_buckets([3], 2) -> [1, 2]."""
    top = bucket(min(max(batches, default=0), cap), cap) if batches else 0
    out, b = [], 1
    while b <= top:
        out.append(b)
        b = bucket(b + 1, cap) if b < cap else cap + 1
    return out


def prefill_chunk(take: int, block: int) -> int:
    """Tokens of a graph-prefill chunk when the scheduler could take `take` >= 0 prompt tokens: one `block` (64) at
    most, under a block the largest power of two <= take, so a remainder of 1..63 tokens comes in chunks of
    CHUNK_LENGTHS (and a last 1, decode-shaped), whose graphs the warm-up captured.
    Examples: (200, 64) -> 64; (29, 64) -> 16, then (13, 64) -> 8, 4, 1; (0, 64) -> 0.

    No chunk crosses a 64-token block boundary, so the prefix-cache snapshots (one at each boundary, written where a
    chunk ends on it) fall where they do with whole-remainder chunks."""
    if take >= block:
        return block
    return 1 << (take.bit_length() - 1) if take > 0 else 0


class GraphRunner:
    """The static-buffer steps of a ModelRunner (module docstring): `step`, `verify`, `mtp` and `commit` run one
    step of their kind; `register`, `buffers` and `launch` serve functions of other layers."""

    def __init__(self, runner, max_pages: int, capture: bool, compile: bool = False, max_graphs: int = MAX_GRAPHS,
                 max_tail_graphs: int = MAX_TAIL_GRAPHS):
        """runner: the ModelRunner (model, pools, layer maps); max_pages: latent pages of one sequence at
        max_model_len (0 = the whole pool); capture: record CUDA graphs (needs a CUDA model), else run the functions
        eagerly on the buffers; compile: decode and verify shapes through torch.compile before their capture."""
        if capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, got {runner.device}; set "
                             f"ServeConfig.cuda_graphs=False")
        self.runner, self.capture = runner, capture
        self.page_size, self.max_seqs = runner.pages.page_size, runner.states.num_slots
        self.max_pages = max(1, min(max_pages or runner.pages.num_pages, runner.pages.num_pages))
        self.spec_tokens = runner.states.spec_tokens
        self.geom = (runner.cfg.vocab_size, self.page_size, runner.pages.num_pages)
        self.max_graphs, self.max_tail_graphs, self.used, self._cap_logged = max_graphs, max_tail_graphs, 0, set()
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.compile = compile
        # static shapes: every bucket is its own compiled graph, as it is its own CUDA graph
        self._compiled = {"step": torch.compile(lambda b: step_forward(runner, b), dynamic=False)} if compile else {}
        self._warming = False
        self.shapes: dict[tuple, StaticBuffers] = {}
        self._route: dict[tuple, tuple] = {}  # the compiled-bucket choice of a key, reset when a shape is added
        self.calls: dict[str, int] = {"step": 0, "verify": 0, "mtp": 0}  # steps served per kind
        self.dtype = next(runner.model.parameters()).dtype

    # ------------------------------------------------------------------------------------------ what qualifies

    def accepts_step(self, seqs: list[StepSeq]) -> bool:
        """Every sequence brings the same 1..64 tokens with "last" or "none" logits, no verify, and snapshots only
        at the end of its chunk (written after the run from the pools; an interior boundary needs the chunk
        kernel's states: eager)."""
        if not 0 < len(seqs) <= self.max_seqs:
            return False
        T = len(seqs[0].tokens)
        return 1 <= T <= RECURRENT_MAX_TOKENS and all(
            len(s.tokens) == T and s.logits in ("last", "none") and not s.spec for s in seqs) and ends_at_step_end(seqs)

    def accepts_verify(self, seqs: list[StepSeq]) -> bool:
        """Every sequence verifies 1 + drafts tokens (2 <= T_n <= 1 + spec_tokens; lengths may differ) with "all"
        logits and no snapshot to write."""
        return self.spec_tokens > 0 and 0 < len(seqs) <= self.max_seqs and all(
            s.spec and s.logits == "all" and not s.snapshots and 2 <= len(s.tokens) <= 1 + self.spec_tokens
            for s in seqs)

    def accepts_mtp(self, seqs: list[StepSeq]) -> bool:
        """1..spec_tokens + 2 pairs per sequence (a catch-up after a longer prefill chunk runs eagerly)."""
        return 0 < len(seqs) <= self.max_seqs and all(1 <= len(s.tokens) <= self.spec_tokens + 2 for s in seqs)

    # ------------------------------------------------------------------------------------------ the steps

    @torch.no_grad()
    def step(self, seqs: list[StepSeq]) -> StepOutput | None:
        """One decode or prefill-chunk step (caches updated in place, as the eager step). None: more pages than the
        largest page bucket (the caller runs the eager step)."""
        B, T = len(seqs), len(seqs[0].tokens)
        buf = self.buffers_for("step", seqs, T)
        if buf is None:
            return None
        self.calls["step"] += 1
        logits, hidden = self.launch(buf, step_layout(seqs, buf, self.geom, self.max_seqs, None))
        logits, hidden = logits[:B], hidden[:B * T]  # real rows: [B, V_], [B * T, D] (already packed)
        if self.capture:
            logits, hidden = logits.clone(), hidden.clone()  # the static outputs get overwritten by the next replay
        r = self.runner
        if r.snaps is not None:
            write_step_end_snapshots(r.snaps, r.states, seqs, hidden, T)
        return StepOutput(logits=[logits[n:n + 1] if s.logits == "last" else None for n, s in enumerate(seqs)],
                          hidden_last=hidden[T - 1::T], hidden=hidden, cu=list(range(0, B * T + 1, T)))

    @torch.no_grad()
    def verify(self, seqs: list[StepSeq]) -> tuple[StepOutput, VerifyRecord] | None:
        """One verify step: per-token KDA states into the scratch slots, latents into the pages (the conv tails are
        left to the rollback). Returns (the StepOutput of the real rows, packed: logits[n] [T_n, V_], hidden
        [sum T_n, D]; the record the rollback reads), or None (more pages than the largest bucket)."""
        lens = [len(s.tokens) for s in seqs]
        B, T = len(seqs), max(lens)
        buf = self.buffers_for("verify", seqs, T)
        if buf is None:
            return None
        outs = self.launch_verify(seqs, buf)
        logits, hidden_pad = outs[0][:B * T], outs[1]  # [B * T, V_], [Bb * T, D] padded layout (row n at n * T)
        if self.capture:
            logits = logits.clone()
        cu = [0]
        for L in lens:
            cu.append(cu[-1] + L)
        # gathers (new tensors, so no clone): the real rows packed as the eager path's, each row's last real token
        out = StepOutput(logits=[logits[n * T:n * T + L] for n, L in enumerate(lens)],
                         hidden_last=hidden_pad.index_select(0, buf.last_rows[:B]),
                         hidden=hidden_pad.index_select(0, buf.real_rows[:cu[-1]]), cu=cu)
        return out, VerifyRecord(seqs, list(range(0, B * T + 1, T)), outs[1], buf, [None] * B)

    def launch_verify(self, seqs: list[StepSeq], buf: StepBuffers) -> tuple[torch.Tensor, ...]:
        """The verify forward of `seqs` on `buf`: host inputs in, graph replayed (or the function run); sets buf.pre
        (what the rollback reads). Returns step_forward's outputs (static when captured)."""
        self.calls["verify"] += 1
        outs = self.launch(buf, step_layout(seqs, buf, self.geom, self.max_seqs, self.runner.states.token_slot))
        buf.pre = outs[2:]
        return outs

    @torch.no_grad()
    def mtp(self, seqs: list[StepSeq], hidden_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The MTP block over pairs (hidden_TD rows, seqs[n].tokens) at MTP slots start.. ; returns (output before
        its norm [B, D], fp32 logits [B, V_]) at each sequence's last pair, or None (eager)."""
        B, T = len(seqs), max(len(s.tokens) for s in seqs)
        D = self.runner.cfg.d_model
        if hidden_TD.shape != (sum(len(s.tokens) for s in seqs), D):
            raise ValueError(f"MTP step: hidden must be [{sum(len(s.tokens) for s in seqs)}, {D}] (one row per "
                             f"pair), got {tuple(hidden_TD.shape)}")
        buf = self.buffers_for("mtp", seqs, T)
        if buf is None:
            return None
        self.calls["mtp"] += 1
        h = hidden_TD.to(self.dtype)
        x, logits = (t[:B] for t in self.launch(buf, mtp_layout(seqs, buf, self.geom),
                                                lambda: torch.index_select(h, 0, buf.hid_rows, out=buf.hidden_in)))
        if self.capture:
            x, logits = x.clone(), logits.clone()
        return x, logits

    @torch.no_grad()
    def commit(self, record: VerifyRecord, prepare=None) -> None:
        """Roll every sequence of a verify step back to its accepted length (record.kept, all set) in one call: a
        graph per verify shape, captured on first use (beyond the cap or if the capture fails: eagerly).
        `prepare()` runs after the host inputs are copied in and before the rollback (k3.serve.spec_step writes the
        accepted lengths there by device ops)."""
        buf = record.buf
        c = buf.commit
        host = commit_layout(record, self.runner.states.token_slot)
        if self.capture and buf.graph is not None and c.graph is None and not c.failed and self.used < self.max_graphs:
            self.capture_fn(c, (buf.Bb, buf.T, buf.Gb, "commit"), lambda _: commit_forward(self.runner, buf),
                            commit_inert)
        self.launch(c, host, prepare, fn=lambda _: commit_forward(self.runner, buf))

    # ------------------------------------------------------------------------------------------ shapes

    def page_bucket(self, G: int) -> int:
        """Block-table width of a step whose longest sequence has G pages: one width (max_pages) on the Triton paged
        kernel, which reads keys up to each row's position only (one graph and compilation per batch bucket);
        powers of two on its PyTorch twin, which gathers every page of the table."""
        if paged_attention_bounded(self.runner.device):
            return self.max_pages
        return bucket(G, self.max_pages)

    def buffers_for(self, kind: str, seqs: list[StepSeq], T: int) -> StaticBuffers | None:
        """The buffers of shape (kind, batch bucket, T, page bucket) that serve `seqs`; None when the longest block
        table is wider than the largest page bucket. With compile on, decode and verify steps route to the smallest
        larger compiled batch bucket of their shape (module docstring)."""
        G = max(len(s.block_table) for s in seqs)
        if G > self.max_pages:
            return None
        key = (kind, bucket(len(seqs), self.max_seqs), T, self.page_bucket(G))
        if self.compile and self._compilable(key):
            if (routed := self._route.get(key)) is None:
                routed = self._route[key] = self._compiled_bucket(key)
            key = routed
        return self.buffers(*key)

    @staticmethod
    def _compilable(key: tuple) -> bool:
        return key[0] == "verify" or (key[0] == "step" and key[2] == 1)

    def _compiled_bucket(self, key: tuple) -> tuple:
        """`key` itself when it is compiled or no larger compiled batch bucket of its kind, T and page shape exists,
        else the smallest such. Example: compiled (step, 1, 1, G) and (step, 32, 1, G): (step, 8, 1, G) -> 32."""
        own = self.shapes.get(key)
        if own is not None and own.compiled:
            return key
        up = [k for k, b in self.shapes.items()
              if b.compiled and not b.failed and k[0] == key[0] and k[2:] == key[2:] and k[1] >= key[1]]
        return min(up) if up else key

    def buffers(self, kind: str, Bb: int, T: int, Gb: int) -> StaticBuffers:
        """The static buffers of one shape, created (and captured when graphs are on and the caps allow) on first
        use. A shape without a graph runs its function eagerly on the buffers."""
        key = (kind, Bb, T, Gb)
        buf = self.shapes.get(key)
        if buf is None:
            dev = self.runner.device
            if kind == "mtp":
                buf = MTPBuffers(Bb, T, Gb, self.runner.cfg.d_model, self.dtype, dev)
            else:
                buf = StepBuffers(kind, Bb, T, Gb, dev)
            self.shapes[key] = buf
            self._route.clear()
            if self.capture and self._may_capture(key):
                compiled = self._warming and self.compile and self._compilable(key)
                self.capture_fn(buf, key, self._compiled["step"] if compiled else self._function(kind), fill_inert)
                buf.compiled = compiled and buf.graph is not None
        return buf

    def _may_capture(self, key: tuple) -> bool:
        """Within the graph cap, and for an odd prefill length within the tail cap (one warning per cap)."""
        kind, _, T, _ = key
        if kind == "step" and T > 1 and T not in CHUNK_LENGTHS:
            odd = sum(1 for k, b in self.shapes.items()
                      if k[0] == "step" and k[2] > 1 and k[2] not in CHUNK_LENGTHS and b.graph is not None)
            if odd >= self.max_tail_graphs:
                self._warn_cap("tail", f"%d prefill-chunk graphs of lengths other than {CHUNK_LENGTHS} captured (their "
                               "cap); other such shapes run eagerly", odd)
                return False
        if self.used >= self.max_graphs:
            self._warn_cap("all", "%d CUDA graphs captured (the cap); other shapes run eagerly", self.used)
            return False
        return True

    def _warn_cap(self, which: str, msg: str, n: int) -> None:
        if which not in self._cap_logged:
            log.warning("CUDA graphs: " + msg, n)
            self._cap_logged.add(which)

    def _function(self, kind: str):
        if kind == "mtp":
            return lambda b: mtp_forward(self.runner, b)
        return lambda b: step_forward(self.runner, b)

    # ------------------------------------------------------------------------------------------ capture / run

    def capture_fn(self, buf: StaticBuffers, key: tuple, fn, inert) -> None:
        """Warm the shape up eagerly on a side stream with inert inputs, then capture `fn(buf)` (PyTorch's CUDA-graph
        recipe: docs.pytorch.org/docs/stable/notes/cuda.html#cuda-graphs). A failure marks the shape eager."""
        inert(buf)
        t0 = time.monotonic()
        try:
            with torch.cuda.device(self.runner.device), torch.no_grad():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        self._call(fn, buf)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: CUDA calls of other threads (the HTTP side) do not invalidate the engine's capture
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    out = self._call(fn, buf)
                buf.outputs = () if out is None else tuple(out)  # a function that only writes caches returns None
            buf.graph = graph
            self.used += 1
            log.info("captured the graph of shape %s in %.1f s", key, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - never crash the server over a graph: that shape stays eager
            buf.failed, buf.graph, buf.outputs = True, None, None
            log.warning("CUDA graph capture failed for shape %s (%s: %s); that shape runs eagerly from now on", key,
                        type(e).__name__, e)

    def _call(self, fn, buf):
        if fn is self._compiled.get("step"):  # one compiled graph per bucket: raise the recompile limit for it
            with torch._dynamo.config.patch(recompile_limit=self.max_graphs + 1):
                return fn(buf)
        return fn(buf)

    def launch(self, buf: StaticBuffers, host: torch.Tensor, prepare=None, fn=None) -> tuple[torch.Tensor, ...]:
        """Copy the host inputs (one CPU int64 tensor in buf's layout) into the buffers, run `prepare()` (device-side
        input copies), then replay the graph (its static outputs, overwritten by the next replay) or run the
        function eagerly (`fn`, default the kind's)."""
        if buf.graph is not None:
            buf.ints.copy_(host.pin_memory(), non_blocking=True)  # stream-ordered before the replay
            if prepare is not None:
                prepare()
            buf.graph.replay()
            return buf.outputs
        buf.ints.copy_(host)
        if prepare is not None:
            prepare()
        if fn is None:  # without capture, compile on runs the compiled function itself (the CPU test of inductor)
            compiled = self.compile and not self.capture and self._compilable((buf.kind, buf.Bb, buf.T))
            fn = self._compiled["step"] if compiled else self._function(buf.kind)
        out = self._call(fn, buf)
        return () if out is None else tuple(out)

    def capture_common(self, batches=COMMON_BATCHES) -> None:
        """Warm-up (before /health turns 200): the decode shapes of `batches` (compiled with compile on; without it
        every power-of-two bucket up to the largest too: streams joining one by one pass through all of them, and a
        capture met while serving stalls every running stream), the prefill chunks of CHUNK_LENGTHS for every
        bucket up to the largest (the engine prefills prompts of up to 512 tokens in them, batched across requests
        that arrive together), and with speculation the verify shape T = 1 + k and the MTP shapes T = 1..k + 2 of
        `batches`. No-op without capture."""
        if not self.capture:
            return
        g1, cap = self.page_bucket(1), self.max_seqs
        buckets = sorted({bucket(b, cap) for b in batches if b <= cap})
        self._warming = True
        try:
            for Bb in buckets:
                self.buffers("step", Bb, 1, g1)
            if self.spec_tokens:
                for Bb in buckets:
                    self.buffers("verify", Bb, 1 + self.spec_tokens, g1)
        finally:
            self._warming = False
        if not self.compile:
            for Bb in warm_buckets(batches, cap):
                self.buffers("step", Bb, 1, g1)
        for Bb in warm_buckets(batches, cap):
            for T in reversed(CHUNK_LENGTHS):
                self.buffers("step", Bb, T, g1)
        if self.spec_tokens and self.runner.model.mtp is not None:
            for Bb in buckets:
                for T in range(1, self.spec_tokens + 3):
                    self.buffers("mtp", Bb, T, g1)

    @property
    def num_graphs(self) -> int:
        return self.used
