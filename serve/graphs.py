"""Decode fast path: one engine step of plain decodes as a fixed-shape function of static buffers, replayed from
CUDA graphs (serving.md 2.5, "Decode runs as whole-step CUDA graphs per batch-size bucket"; issue 5).

A step qualifies when every scheduled sequence decodes exactly one token with "last" logits and no speculative verify
(`DecodeGraphs.accepts`); the prefix-cache snapshots of tokens that complete a block are copied from the pools after
the replay. Every other step runs ModelRunner's eager path.

Shapes. Batch buckets Bb = 1, 2, 4, 8, ... capped at max_num_seqs (the state pool's slots). Page buckets Gb = 1, 2,
4, ... capped at the pages of one sequence at max_model_len, on the PyTorch attention path; with the Triton paged
kernel, which reads keys up to each row's position only, one width (max pages) serves every step (`page_bucket`).
A step of B sequences whose longest block table has G pages runs shape (bucket(B), page_bucket(G)); its MLA attends
to keys <= position (k3.kernels.mla.paged_mla_decode, as the runner), so short contexts do not pay for
max_model_len. On CUDA a shape's graph is captured on first use (the common ones by `capture_common` in
Engine.warmup), at most `max_graphs` of them; beyond the cap, or for a shape whose capture raised (one warning
naming the reason), the step runs the eager path.

Padding needs no scratch slot or page. Padded rows b >= B copy real row 0's inputs (token, position, slots, block
table), and every cache write of a padded row puts row 0's value at row 0's location, so an index written twice
receives the same value twice (deterministic with duplicate indices on any device) and no other slot or page is
touched:
- KDA recurrence: padded rows pass slot -1 (start from zeros, write nothing; a duplicate slot would race inside the
  kernel) to `fused_recurrent_kda_pool_trusted`, which skips the host-side validation (done here on host ints);
- conv tails and latents: row b writes the value of row `src_rows[b]` (0 for padded rows) to its target.
With `live` = 0 every cache write puts back the value it just read: warm-up runs before a capture use such inert
inputs, so they leave every slot and page bit-identical while the real step's inputs are not yet in the buffers.

The machinery (shape buckets, lazy capture with warm-up, the graph cap, torch.compile, one int64 input buffer per
shape) is `StaticGraphs`, shared with the verify and MTP draft fast paths of k3.serve.spec_graphs; all of a
runner's graphs share one memory pool and one cap (`GraphBudget`).

A graph holds the whole step: embedding, every layer (norms, AttnRes mixes, KDA with conv tails and the in-place
recurrent pool update, MLA with the latent write and paged absorbed attention, dense MLP or MoE through
torch._grouped_mm), the final norm and the LM head. Inputs: one int64 buffer [7 * Bb + Bb * Gb]; outputs: logits
[Bb, V_] fp32 and the final hidden [Bb, D]. A replay is one host-to-device copy plus one graph launch.

Legend: B sequences, Bb batch bucket, Gb page bucket, D width, V_ vocab, H heads, K head dim, C channels (KDA) or
kv_lora (MLA), R rope dim, X = C + R latent width, W conv kernel.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from k3.kernels.conv import causal_conv1d
from k3.kernels.dispatch import kernel_backend
from k3.kernels.mla import paged_mla_decode
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA

from .prefill import ends_at_step_end, write_step_end_snapshots
from .runner import (
    ModelRunner,
    StepOutput,
    StepSeq,
    final_logits,
    kda_output,
    kda_pool_step,
    mla_output,
    mla_project,
)

log = logging.getLogger("k3.serve")

# Captured graphs at most, decode + prefill chunks + verify + MTP + post-verify together (one memory pool); beyond:
# eager. The default warm-up (batches 1, 8, 32) alone captures 6 decode + 36 prefill-chunk (6 buckets x 6 lengths,
# k3.serve.tail_graphs) graphs, with k speculative tokens 3 verify + 3 (k + 2) MTP + 3 post-verify more: 60 at k = 2,
# 66 at k = 4, so 64 left no room for the shapes met while serving (other buckets, page buckets, draft counts).
# Memory: each graph keeps its static outputs (activations share the pool); for k3-small the 36 chunk graphs hold
# logits [Bb, 32768] fp32 + hidden [Bb * Tn, 768] bf16 = sum over Bb of 6 x Bb x 128 KiB + Bb x 126 x 1.5 KiB
# ~= 59 MiB (at most ~7 MiB for one, Bb 32 x Tn 64); any graph's logits cost 128 KiB per row (a verify graph of
# 32 x 3 rows: 12 MiB), so even 128 graphs stay near 1 GiB at worst of an H200's 141 GB.
MAX_GRAPHS = 128
COMMON_BATCHES = (1, 8, 32)  # capture_common's default batches (the engine passes ServeConfig.cuda_graph_batches)
WARMUP_RUNS = 2  # eager runs on a side stream before a capture (lazy inits, Triton compilation, MoE probe)
_FIELDS = ("tokens", "kda_slots", "tail_slots", "src_rows", "live", "positions", "slot_mapping")


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


class StaticBuffers:
    """The static integer inputs of one shape: named views of one int64 buffer `ints` (so a step's inputs travel in
    one host-to-device copy), plus the shape's captured graph and its static outputs."""

    def __init__(self, fields: list[tuple[str, tuple[int, ...]]], device: torch.device):
        """fields: (name, shape) in buffer order; each becomes an attribute viewing its part of `ints`."""
        sizes = [math.prod(shape) for _, shape in fields]
        self.ints = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        off = 0
        for (name, shape), n in zip(fields, sizes):
            setattr(self, name, self.ints[off:off + n].view(shape))
            off += n
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed = False  # capture raised: this shape runs the eager path for good
        self.compiled = False  # captured from the torch.compile'd function (StaticGraphs.buffers_for prefers these)
        self.outputs: tuple[torch.Tensor, ...] | None = None  # static outputs of the captured graph


class DecodeBuffers(StaticBuffers):
    """Static inputs of one (Bb, Gb) shape, all views of one int64 buffer `ints` [7 * Bb + Bb * Gb]:
    tokens [Bb]; kda_slots [Bb] (recurrent state slot, -1 for padded rows); tail_slots [Bb] (conv-tail row read and
    written); src_rows [Bb] (the row whose tails/latents are written at row b's targets); live [Bb] (0 = write back
    what was read); positions [Bb]; slot_mapping [Bb] (flat latent row of the new token); block_table [Bb, Gb]."""

    def __init__(self, Bb: int, Gb: int, device: torch.device):
        super().__init__([(name, (Bb,)) for name in _FIELDS] + [("block_table", (Bb, Gb))], device)
        self.Bb, self.Gb = Bb, Gb


class GraphBudget:
    """What the fast paths of one runner share: the CUDA-graph memory pool (graphs replay one at a time on the engine
    thread, so their activations can share memory) and the cap on captured graphs."""

    def __init__(self, capture: bool, max_graphs: int):
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.max_graphs, self.used, self.logged = max_graphs, 0, False


class StaticGraphs:
    """Shape buckets of one fixed-shape step function `fn(buffers) -> tuple of tensors`: static buffers per shape key,
    created (and on CUDA captured) on first use, at most `budget.max_graphs` captured graphs in all; a shape over the
    cap or whose capture raised runs the caller's eager path. Subclasses (DecodeGraphs here, VerifyGraphs and
    MTPGraphs in k3.serve.spec_graphs) define `new_buffers(*key)` (the StaticBuffers of a shape) and
    `fill_inert(buf)` (inputs whose run changes no cache, for the warm-up runs before a capture). `calls` counts the
    steps served."""

    kind = "decode"  # for log messages

    def __init__(self, runner: ModelRunner, fn, max_pages: int, capture: bool, max_graphs: int, compile: bool,
                 budget: GraphBudget | None):
        """fn: the step function of static buffers; max_pages: latent pages of one sequence at max_model_len (0 = the
        whole page pool); capture: record CUDA graphs (needs a CUDA model), else run fn eagerly on the same buffers
        (CPU tests); compile: fn through torch.compile, compiled once per shape before its capture; budget: the
        pool and graph cap shared with the runner's other fast paths (None: a new one of max_graphs)."""
        if capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, got {runner.device}; set "
                             f"ServeConfig.cuda_graphs=False or pass capture=False")
        self.runner, self.model = runner, runner.model
        # static shapes: every bucket is its own compiled graph, as it is its own CUDA graph
        self.forward = self._compiled if compile else fn
        self._compiled_fn = torch.compile(fn, dynamic=False) if compile else None
        # with compile on, only the warm-up's shapes (capture_common) are compiled before capture; a shape first met
        # while serving is captured from the plain function, so a request never waits for a minute-long compile
        self._plain_fn, self._warming = fn, False
        self.page_size = runner.pages.page_size
        self.max_seqs = runner.states.num_slots
        self.max_pages = max(1, min(max_pages or runner.pages.num_pages, runner.pages.num_pages))
        self.capture = capture
        self.budget = budget if budget is not None else GraphBudget(capture, max_graphs)
        self.max_graphs = self.budget.max_graphs
        self.vocab = runner.cfg.vocab_size
        self.shapes: dict[tuple[int, ...], StaticBuffers] = {}
        self._route: dict[tuple[int, ...], tuple[int, ...]] = {}  # buffers_for's shape choice, reset on a new shape
        self.num_graphs = 0  # graphs of this kind captured
        self.calls = 0  # steps this fast path served

    def page_bucket(self, G: int) -> int:
        """Block-table width of a step whose longest sequence has G pages. The Triton paged kernel reads keys up to
        each row's position only, so on that backend one width (max_pages) serves every context length: one graph
        (and one compilation) per batch bucket. The PyTorch twin gathers every page of the table, so there the width
        follows G in powers of two."""
        if self.runner.device.type == "cuda" and kernel_backend() == "triton":
            return self.max_pages
        return bucket(G, self.max_pages)

    def check_table(self, bt: list[int], first: int, last: int, what: str) -> None:
        """Host-side checks of one sequence's block table before its indices reach the trusted kernels: positions
        first..last inside the table, page ids inside the pool."""
        n = self.runner.pages.num_pages
        if not 0 <= first <= last < len(bt) * self.page_size or min(bt) < 0 or max(bt) >= n:
            raise ValueError(f"{what}: positions {first}..{last} outside its {len(bt)} pages of {self.page_size}, or "
                             f"a page id outside [0, {n}) in {bt}")

    def buffers_for(self, seqs: list[StepSeq], *inner: int) -> StaticBuffers | None:
        """The buffers of shape (batch bucket, *inner, page bucket) that serve `seqs`; None = run eagerly (more pages
        than the largest bucket, over the graph cap, or a failed capture). With compile on, a step whose own bucket
        has no compiled graph runs the smallest larger compiled bucket of the same inner and page shape instead
        (padded rows are inert): on an H200 k3-small's compiled batch-32 decode step took ~4.2 ms, its plain
        batch-1 graph 7.1 ms, so 5 streams run faster padded to 32 than in a plain graph of their own bucket 8."""
        G = max(len(s.block_table) for s in seqs)
        if G > self.max_pages:
            return None
        key = (bucket(len(seqs), self.max_seqs), *inner, self.page_bucket(G))
        if self._compiled_fn is not None:
            if (routed := self._route.get(key)) is None:
                routed = self._route[key] = self.compiled_bucket(key)
            key = routed
        return self._buffers(*key)

    def compiled_bucket(self, key: tuple[int, ...]) -> tuple[int, ...]:
        """`key` itself when it is compiled or no larger compiled batch bucket of its inner and page shape exists,
        else the smallest such bucket's key. Example: compiled (1, G) and (32, G): (8, G) -> (32, G); (1, G) -> (1, G)."""
        own = self.shapes.get(key)
        if own is not None and own.compiled:
            return key
        up = [k for k, b in self.shapes.items() if b.compiled and not b.failed and k[1:] == key[1:] and k[0] >= key[0]]
        return min(up) if up else key

    def _buffers(self, *key: int) -> StaticBuffers | None:
        """The static buffers of shape `key`, captured first when graphs are on; None = run eagerly."""
        buf = self.shapes.get(key)
        if buf is None:
            if self.capture and self.budget.used >= self.budget.max_graphs:
                if not self.budget.logged:
                    log.warning("CUDA graphs: %d graphs captured (the cap); other shapes run eagerly",
                                self.budget.used)
                    self.budget.logged = True
                return None
            buf = self.shapes[key] = self.new_buffers(*key)
            self._route.clear()
            if self.capture:
                self._capture(buf, key, fn=None if self._warming else self._plain_fn)
        return None if buf.failed else buf

    def _warm(self, *key: int) -> StaticBuffers | None:
        """_buffers for capture_common: the warm-up's shapes are the ones compiled (with compile on)."""
        self._warming = True
        try:
            return self._buffers(*key)
        finally:
            self._warming = False

    def _capture(self, buf: StaticBuffers, key: tuple, fn=None, inert=None) -> None:
        """Warm the shape up eagerly on a side stream with inert inputs, then capture it (PyTorch's CUDA-graph
        recipe: docs.pytorch.org/docs/stable/notes/cuda.html#cuda-graphs). A failure marks the shape eager.
        fn / inert: the function captured and its inert-input filler (default: self.forward / self.fill_inert)."""
        fn, inert = fn or self.forward, inert or self.fill_inert
        compiled = fn == self.forward and self._compiled_fn is not None  # self.forward runs the compiled function
        inert(buf)
        dev = self.runner.device
        t0 = time.monotonic()
        try:
            with torch.cuda.device(dev), torch.no_grad():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        fn(buf)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: CUDA calls of other threads (the HTTP side) do not invalidate the engine's capture
                with torch.cuda.graph(graph, pool=self.budget.pool, capture_error_mode="thread_local"):
                    out = fn(buf)
                buf.outputs = () if out is None else tuple(out)  # a function that only writes caches returns None
            buf.graph, buf.compiled = graph, compiled
            self.num_graphs += 1
            self.budget.used += 1
            log.info("captured the %s graph of shape %s in %.1f s%s", self.kind, key, time.monotonic() - t0,
                     " (compiled)" if compiled else "")
        except Exception as e:  # noqa: BLE001 - never crash the server over a graph: that shape stays eager
            buf.failed, buf.graph, buf.outputs = True, None, None
            log.warning("%s CUDA graph capture failed for shape %s (%s: %s); that shape runs eagerly from now on",
                        self.kind, key, type(e).__name__, e)

    def _launch(self, buf: StaticBuffers, host: torch.Tensor, prepare=None) -> tuple[torch.Tensor, ...]:
        """Copy the host inputs (one CPU int64 tensor in buf's layout) into the buffers, run `prepare()` (other
        device-side input copies), then replay the graph (its static outputs, overwritten by the next replay) or,
        without capture, run the function eagerly on the buffers."""
        self.calls += 1
        if self.capture:
            buf.ints.copy_(host.pin_memory(), non_blocking=True)  # stream-ordered before the replay
            if prepare is not None:
                prepare()
            buf.graph.replay()
            return buf.outputs
        buf.ints.copy_(host)
        if prepare is not None:
            prepare()
        return tuple(self.forward(buf))

    @torch.no_grad()
    def _compiled(self, buf: StaticBuffers) -> tuple[torch.Tensor, ...]:
        """The step function through torch.compile; one compiled graph per bucket, so the recompile limit (8 by
        default, per code object) is raised to the graph cap for these calls only."""
        with torch._dynamo.config.patch(recompile_limit=self.max_graphs + 1):
            return self._compiled_fn(buf)


def write_and_attend(attn: GatedMLA, kv_pool: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                     slot_mapping: torch.Tensor, src: torch.Tensor, live: torch.Tensor, block_table: torch.Tensor,
                     T: int, min_key: int = 0) -> torch.Tensor:
    """Absorbed MLA of Bb rows of T queries each over their pages (kv_pool [P, page, X], block_table [Bb, Gb]):
    x [1, Bb * T, D] at positions [Bb * T] -> [1, Bb * T, D]. The new latents go into the pages first (every query
    attends to itself): token i writes the latent of token src[i] at flat row slot_mapping[i], or puts back what was
    there when live[i] is False (padded rows and inert runs write values that are already there or identical).
    Keys below `min_key` are masked (the MTP's empty slot 0)."""
    q_lat, q_rope, latent = mla_project(attn, x, positions)  # [N, H, C], [N, H, R], [N, X]
    flat = kv_pool.view(-1, kv_pool.shape[-1])
    old = flat[slot_mapping]
    flat[slot_mapping] = torch.where(live[:, None], latent[src].to(flat.dtype), old)
    Bb = block_table.shape[0]
    o_lat = paged_mla_decode(q_lat.view(Bb, T, *q_lat.shape[1:]), q_rope.view(Bb, T, *q_rope.shape[1:]), kv_pool,
                             block_table, positions.view(Bb, T), scale=attn.softmax_scale,
                             min_key=min_key)  # [Bb, T, H, C]
    return mla_output(attn, x, o_lat.flatten(0, 1))


class DecodeGraphs(StaticGraphs):
    """The decode fast path of a ModelRunner: `accepts(seqs)`, then `step(seqs)` -> StepOutput or None (eager)."""

    def __init__(self, runner: ModelRunner, max_pages: int, capture: bool, max_graphs: int = MAX_GRAPHS,
                 compile: bool = False, budget: GraphBudget | None = None):
        """max_pages: latent pages of one sequence at max_model_len (0 = the whole page pool); capture: record CUDA
        graphs (needs a CUDA model), else run the same static-buffer function eagerly (CPU tests); compile: run
        decode_forward through torch.compile (inductor fuses the norms, AttnRes mixes and gates, which dominate a
        decode step's ~2,500 small kernels), compiled once per shape bucket before its capture."""
        super().__init__(runner, self.decode_forward, max_pages, capture, max_graphs, compile, budget)

    # ------------------------------------------------------------------------------------------------ engine side

    def accepts(self, seqs: list[StepSeq]) -> bool:
        """True when every sequence is a plain decode: 1 new token, "last" logits, no verify. A snapshot (the token
        completes a block) is written after the replay from the pools (k3.serve.prefill.write_step_end_snapshots):
        with prefix caching on, staggered sequences cross a block boundary in a large share of steps."""
        return 0 < len(seqs) <= self.max_seqs and all(
            len(s.tokens) == 1 and s.logits == "last" and not s.spec for s in seqs) and ends_at_step_end(seqs)

    @torch.no_grad()
    def step(self, seqs: list[StepSeq]) -> StepOutput | None:
        """Run one plain-decode step (caches updated in place, as ModelRunner.step). Returns None when this shape
        must run the eager path (over the graph cap, capture failed, or more pages than the largest bucket)."""
        B = len(seqs)
        buf = self.buffers_for(seqs)
        if buf is None:
            return None
        logits, hidden = (t[:B] for t in self._launch(buf, self._host_inputs(seqs, buf.Bb, buf.Gb)))
        if self.capture:
            logits, hidden = logits.clone(), hidden.clone()  # the static outputs get overwritten
        if self.runner.snaps is not None:
            write_step_end_snapshots(self.runner.snaps, self.runner.states, seqs, hidden, 1)
        return StepOutput(logits=[logits[n:n + 1] for n in range(B)], hidden_last=hidden, hidden=hidden,
                          cu=list(range(B + 1)))

    def capture_common(self, batches=COMMON_BATCHES) -> None:
        """Capture the buckets of `batches` (those <= max_num_seqs) for the smallest page bucket (warmup), compiled
        with compile on. Without compile, every other power-of-two bucket up to the largest is captured too (plain,
        a fraction of a second each for k3-small): streams joining one by one pass through all of them, and a capture
        met while serving stalls every running stream for its duration (the first wave of 32 streams on an H200 saw
        a 1.2 s p99 time to first token). With compile on those buckets are not needed: buffers_for runs a step on
        the smallest larger compiled bucket."""
        if not self.capture:
            return
        for Bb in batches:
            if Bb <= self.max_seqs:
                self._warm(bucket(Bb, self.max_seqs), self.page_bucket(1))
        if self._compiled_fn is None:
            for Bb in warm_buckets(batches, self.max_seqs):
                self._buffers(Bb, self.page_bucket(1))

    def new_buffers(self, Bb: int, Gb: int) -> DecodeBuffers:
        return DecodeBuffers(Bb, Gb, self.runner.device)

    def fill_inert(self, buf: DecodeBuffers) -> None:
        self._fill_inert(buf)

    @staticmethod
    def _fill_inert(buf: DecodeBuffers) -> None:
        """Inputs whose run changes nothing: no recurrent slot named, every write puts back what it read (slot 0's
        tails, page 0's first latent row)."""
        buf.ints.zero_()
        buf.kda_slots.fill_(-1)

    def _host_inputs(self, seqs: list[StepSeq], Bb: int, Gb: int) -> torch.Tensor:
        """The step's inputs as one CPU int64 tensor in DecodeBuffers' layout, padded to Bb rows (copies of row 0)
        and Gb pages. Validates what the trusted kernels no longer check on the device (slots in range and
        distinct, tokens in the vocabulary, each position inside its block table, page ids inside the pool)."""
        B, ps = len(seqs), self.page_size
        slots = [s.slot for s in seqs]
        if len(set(slots)) != B or not all(0 <= x < self.max_seqs for x in slots):
            raise ValueError(f"decode step: KDA slots must be distinct and in [0, {self.max_seqs}), got {slots}")
        tokens, pos, smap, table = [], [], [], []
        for s in seqs:
            t, p, bt = s.tokens[0], s.start, s.block_table
            if not 0 <= t < self.vocab:
                raise ValueError(f"decode step: token {t} outside the vocabulary ({self.vocab})")
            self.check_table(bt, p, p, "decode step")
            tokens.append(t)
            pos.append(p)
            smap.append(bt[p // ps] * ps + p % ps)
            table += bt + [0] * (Gb - len(bt))  # pages past the sequence are masked (key > position)
        pad = Bb - B
        rows = [tokens + tokens[:1] * pad, slots + [-1] * pad, slots + slots[:1] * pad,
                list(range(B)) + [0] * pad, [1] * Bb, pos + pos[:1] * pad, smap + smap[:1] * pad]
        flat = [x for r in rows for x in r] + table + table[:Gb] * pad
        return torch.tensor(flat, dtype=torch.long)

    # ------------------------------------------------------------------------------------------------ the step

    def decode_forward(self, buf: DecodeBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode token per row from the static buffers: returns (logits [Bb, V_] fp32, final hidden [Bb, D]
        before the final norm) and updates the KDA slots, conv tails and latent pages in place.

        Only tensor ops on the buffers: no .item()/.tolist()/bool(tensor), no branch on data, no allocation whose
        size depends on data, so CUDA can capture it. Same modules and arithmetic as ModelRunner.step (the shared
        helpers of k3.serve.runner), up to the summation order of the conv and of masked keys."""
        live = buf.live != 0  # [Bb]
        x = self.model.model.embed_tokens(buf.tokens)[None]  # [1, Bb, D]
        hidden = self.model.model.run_layers(x, lambda i, layer, h: self._mixer(i, layer, h, buf, live))[0]
        return final_logits(self.model, hidden), hidden

    def _mixer(self, i: int, layer, x: torch.Tensor, buf: DecodeBuffers, live: torch.Tensor) -> torch.Tensor:
        r = self.runner
        if i in r.kda_index:
            return self._kda(r.kda_index[i], layer.self_attn, x, buf, live)
        # one query per row; the new latents are written into the pages first (the token attends to itself)
        return write_and_attend(layer.self_attn, r.pages.kv[r.mla_index[i]], x, buf.positions, buf.slot_mapping,
                                buf.src_rows, live, buf.block_table, 1)

    def _kda(self, li: int, attn: KimiDeltaAttention, x: torch.Tensor, buf: DecodeBuffers,
             live: torch.Tensor) -> torch.Tensor:
        """KDA of one token per row, x [1, Bb, D] -> [1, Bb, D]; conv tails and recurrent state updated in place."""
        H, K = attn.num_heads, attn.head_k_dim
        qkv = []
        for proj, conv, tail_pool in zip((attn.q_proj, attn.k_proj, attn.v_proj),
                                         (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d), self.runner.states.tails[li]):
            p = proj(x).transpose(0, 1)  # [Bb, 1, C] pre-conv inputs, one token per row
            tail0 = tail_pool[buf.tail_slots]  # [Bb, W-1, C]
            y, tail1 = causal_conv1d(p, conv.weight[:, 0], activation="silu", initial_tail=tail0,
                                     output_final_tail=True)
            tail_pool[buf.tail_slots] = torch.where(live[:, None, None], tail1[buf.src_rows].to(tail_pool.dtype),
                                                    tail0)
            qkv.append(y.unflatten(-1, (H, K)))  # [Bb, 1, H, K]
        q, k, v = qkv
        z, b = attn.gate_input(x).transpose(0, 1), attn.b_proj(x).transpose(0, 1)  # [Bb, 1, H, K], [Bb, 1, H]
        o = kda_pool_step(attn, q, k, v, z, b, self.runner.states.state[li], buf.kda_slots)  # [Bb, 1, H, V]
        return kda_output(attn, x, o.transpose(0, 1))
