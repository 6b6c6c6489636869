"""Prefill-tail fast path: a step of prompt chunks of 2..64 tokens (the tail after a prefix-cache hit, and with CUDA
graphs every prompt of at most 512 tokens) as a fixed-shape function of static buffers replayed from CUDA graphs like
the plain decode steps of k3.serve.graphs (serving.md 2.3 "recompute only the tail" and 2.5; issue 5).

Why. After a hit the engine still prefills 1..64 prompt tokens (KDA states are restored at 64-token block
boundaries and at least one prompt token is always computed, Engine._lookup_prefix). One token is a plain decode
(DecodeGraphs serves it); 2..64 tokens used to run ModelRunner's eager path, which on a GPU is host-bound (thousands
of small kernel launches), so the hit's time to first token was almost all that one step.

A step qualifies when every sequence brings the same Tn new tokens, 2 <= Tn <= RECURRENT_MAX_TOKENS (64), with
"last" or "none" logits, no speculative verify and no snapshot inside its chunk (`TailGraphs.accepts`). Shape
(Bb, Tn, Gb): Bb the batch bucket and Gb the page bucket as in DecodeGraphs; Tn is exact, never padded: an extra
token in a row would move its final KDA state and conv tail past the prompt.

Which lengths. With graph prefill on, the engine cuts a prompt (or the rest after a hit) of at most
GRAPH_PREFILL_MAX_TOKENS into 64-token chunks and the remainder into powers of two, largest first (`prefill_chunk`:
29 = 16 + 8 + 4 + 1, the last token a decode-shaped step), so only Tn in CHUNK_LENGTHS = 2, 4, ..., 64 reach this
path: the warm-up captures all six for every batch bucket (`capture_common`), and no request waits for a capture
(an exact remainder of 1..63 tokens was a capture of ~0.1 s on k3-tiny, and after 16 distinct lengths an eager
step for good, ~70-140 ms of host work on k3-small). A step whose sequences bring different lengths runs one call
per length (ModelRunner._split_step). Other lengths (graph prefill off: a hit's tail on the CPU tests' uncaptured
path) are captured on first use, never compiled, at most MAX_TAIL_GRAPHS of them (they would otherwise fill the
shared cap and leave decode, verify and MTP shapes first met later eager for good); a shape over either cap or
whose capture failed runs eagerly (StaticGraphs).

The function (`tail_forward`), Bb rows of Tn tokens packed as [1, Bb * Tn, D] (row b's token t at b * Tn + t), the
same modules and arithmetic as the runner's eager equal-length step:
- KDA: the batched causal conv over [Bb, Tn, C] from each row's pool tails, the final tail written back; the
  recurrence through the trusted `kda_pool_step` on [Bb, Tn] rows with the row's working slot (only the state after
  its last token is written, as the runner's `_kda_plain` for equal short lengths);
- MLA: `write_and_attend` with T = Tn queries per row at positions start .. start + Tn - 1, every token's latent
  written to its page slot first (Triton's paged kernel takes T * H <= 64 query rows per sequence; longer tails use
  its PyTorch twin, which reads all Gb pages, masked past each query's position);
- the final norm and LM head on each row's last token only.
Outputs: logits [Bb, V_] fp32 and the final hidden [Bb * Tn, D]; the StepOutput is the eager path's for such a
step (logits [1, V_] per sequence, hidden_last [B, D], hidden [B * Tn, D] packed, cu = n * Tn), which the engine
(sampling) and the MTP drafter (catch-up pairs from `hidden` and `cu`) read.

Padded rows b >= B repeat row 0 (tokens, positions, latent rows, tail slot, block table), name no recurrent slot
(-1: start from zeros, write nothing) and write row 0's values at row 0's places (src_tok / src_rows), so an index
written twice gets the same value twice; with live = 0 (the inert warm-up inputs before a capture) every write puts
back what it read (k3.serve.graphs' module docstring).

Legend: B sequences, Bb batch bucket, Tn new tokens per sequence, N = Bb * Tn, Gb page bucket, D width, V_ vocab,
H heads, K head dim, C channels, W conv kernel.
"""

from __future__ import annotations

import logging

import torch

from k3.kernels.conv import causal_conv1d
from k3.model.kda import RECURRENT_MAX_TOKENS, KimiDeltaAttention

from .graphs import COMMON_BATCHES, MAX_GRAPHS, GraphBudget, StaticBuffers, StaticGraphs, warm_buckets, write_and_attend
from .prefill import ends_at_step_end, write_step_end_snapshots
from .runner import ModelRunner, StepOutput, StepSeq, final_logits, kda_output, kda_pool_step

log = logging.getLogger("k3.serve")

MAX_TAIL_GRAPHS = 16  # captured tail graphs of other than CHUNK_LENGTHS at most (of the shared MAX_GRAPHS); beyond: eager
GRAPH_PREFILL_MAX_TOKENS = 512  # with graph prefill, prompts (or rests) up to this length prefill in graph chunks
CHUNK_LENGTHS = tuple(1 << e for e in range(1, RECURRENT_MAX_TOKENS.bit_length()))  # 2, 4, ..., 64: the warm-up's
_TOKEN_FIELDS = ("tokens", "positions", "slot_mapping", "src_tok", "live")  # [N] each
_ROW_FIELDS = ("kda_slots", "tail_slots", "src_rows")  # [Bb] each


def prefill_chunk(take: int, block: int) -> int:
    """Tokens of a graph-prefill chunk (engine `_schedule`, graph prefill on, rest <= GRAPH_PREFILL_MAX_TOKENS) when
    the scheduler could take `take` >= 0 prompt tokens: one `block` (64) at most, and under a block the largest power
    of two <= take, so a remainder of 1..63 tokens comes in chunks of CHUNK_LENGTHS (and a last 1, decode-shaped),
    whose graphs the warm-up captured. Examples: (200, 64) -> 64; (29, 64) -> 16, then (13, 64) -> 8, 4, 1; (0, 64) -> 0.

    No chunk crosses a 64-token block boundary, so the prefix-cache snapshots (one at each boundary, written where a
    chunk ends on it: prefill.ends_at_step_end) fall where they did with whole-remainder chunks: such a prefill
    starts block-aligned (position 0, a hit's block boundary, or after earlier whole blocks), its full chunks end on
    boundaries, and the remainder's chunks all lie inside its last, partial block."""
    if take >= block:
        return block
    return 1 << (take.bit_length() - 1) if take > 0 else 0


class TailBuffers(StaticBuffers):
    """Static inputs of one tail shape (Bb, Tn, Gb), views of one int64 buffer: per token [N] tokens, positions,
    slot_mapping (flat latent row), src_tok (the token whose latent is written at this token's row), live (0 = write
    back what was read; a row's tails follow its first token's flag); per row [Bb] kda_slots (working slot, -1 for
    padded rows), tail_slots (conv-tail row read and written), src_rows (the row whose final tails are written at
    row b's tail slot); block_table [Bb, Gb]."""

    def __init__(self, Bb: int, Tn: int, Gb: int, device: torch.device):
        N = Bb * Tn
        super().__init__([(name, (N,)) for name in _TOKEN_FIELDS] + [(name, (Bb,)) for name in _ROW_FIELDS]
                         + [("block_table", (Bb, Gb))], device)
        self.Bb, self.Tn, self.Gb = Bb, Tn, Gb


class TailGraphs(StaticGraphs):
    """The prefill-tail fast path of a ModelRunner: `accepts(seqs)`, then `step(seqs)` -> StepOutput or None
    (eager)."""

    kind = "prefill tail"

    def __init__(self, runner: ModelRunner, max_pages: int, capture: bool, max_graphs: int = MAX_GRAPHS,
                 budget: GraphBudget | None = None, max_tail_graphs: int = MAX_TAIL_GRAPHS):
        """Arguments as graphs.DecodeGraphs, without `compile`: tail shapes are captured from the plain function
        (up to 63 lengths per batch bucket, each met first while serving: none may wait for a compile);
        max_tail_graphs: tail graphs captured at most, within the shared cap."""
        super().__init__(runner, self.tail_forward, max_pages, capture, max_graphs, False, budget)
        self.max_tail_graphs, self._cap_logged = max_tail_graphs, False

    # ------------------------------------------------------------------------------------------------ engine side

    def accepts(self, seqs: list[StepSeq]) -> bool:
        """True when every sequence brings the same 2..64 tokens with "last" (or "none": a prefill chunk that is not
        the prompt's last) logits, no verify, and snapshots only at
        the end of its tail (written after the replay from the pools; an interior boundary needs the chunk kernel's
        states: eager). One token is DecodeGraphs'; past 64 tokens the eager path runs the chunk kernel."""
        if not 0 < len(seqs) <= self.max_seqs:
            return False
        Tn = len(seqs[0].tokens)
        return 2 <= Tn <= RECURRENT_MAX_TOKENS and all(
            len(s.tokens) == Tn and s.logits in ("last", "none") and not s.spec for s in seqs) and ends_at_step_end(seqs)

    @torch.no_grad()
    def step(self, seqs: list[StepSeq]) -> StepOutput | None:
        """Run one prefill-tail step (caches updated in place, as ModelRunner.step). Returns None when this shape
        must run the eager path (over the graph cap, capture failed, or more pages than the largest bucket)."""
        B, Tn = len(seqs), len(seqs[0].tokens)
        buf = self.buffers_for(seqs, Tn)
        if buf is None:
            return None
        logits, hidden = self._launch(buf, self._host_inputs(seqs, buf))
        logits, hidden = logits[:B], hidden[:B * Tn]  # real rows: [B, V_], [B * Tn, D] (already packed)
        if self.capture:
            logits, hidden = logits.clone(), hidden.clone()  # the static outputs get overwritten by the next replay
        if self.runner.snaps is not None:
            write_step_end_snapshots(self.runner.snaps, self.runner.states, seqs, hidden, Tn)
        return StepOutput(logits=[logits[n:n + 1] if s.logits == "last" else None for n, s in enumerate(seqs)],
                          hidden_last=hidden[Tn - 1::Tn],
                          hidden=hidden, cu=list(range(0, B * Tn + 1, Tn)))

    def _buffers(self, *key: int) -> TailBuffers | None:
        """StaticGraphs._buffers, but a new shape beyond max_tail_graphs captured tail graphs runs eagerly. Chunks of
        CHUNK_LENGTHS do not count against that cap (the engine prefills short prompts in them, six lengths per
        batch bucket): if their shapes ran eagerly, a 512-token prompt would take 8 eager steps instead of 1."""
        if self.capture and key not in self.shapes and key[1] not in CHUNK_LENGTHS and (odd := sum(
                1 for k, b in self.shapes.items() if k[1] not in CHUNK_LENGTHS and not b.failed)) >= self.max_tail_graphs:
            # (counted only for a shape not met yet: a replay pays nothing for the cap)
            if not self._cap_logged:
                log.warning("CUDA graphs: %d prefill-tail graphs of lengths other than %s captured (their cap); other "
                            "such shapes run eagerly", odd, CHUNK_LENGTHS)
                self._cap_logged = True
            return None
        return super()._buffers(*key)

    def capture_common(self, batches=COMMON_BATCHES) -> None:
        """Capture the chunk shapes (Bb, Tn, smallest page bucket) for every batch bucket Bb up to the largest of
        `batches` and every Tn of CHUNK_LENGTHS, 64 first (warmup): the engine prefills prompts of up to 512 tokens
        in such chunks (prefill_chunk), batched across the requests that arrive together, so a burst of requests
        meets these shapes first, and a capture met while serving stalls every running stream. 6 buckets x 6
        lengths = 36 graphs for the default batches (graphs.MAX_GRAPHS counts them). Other lengths are captured on
        first use (see the module docstring)."""
        if self.capture:
            for Bb in warm_buckets(batches, self.max_seqs):
                for Tn in reversed(CHUNK_LENGTHS):
                    self._buffers(Bb, Tn, self.page_bucket(1))

    def new_buffers(self, Bb: int, Tn: int, Gb: int) -> TailBuffers:
        return TailBuffers(Bb, Tn, Gb, self.runner.device)

    def fill_inert(self, buf: TailBuffers) -> None:
        """Inputs whose run changes nothing: no recurrent slot named, every write puts back what it read (slot 0's
        tails, page 0's first latent row)."""
        buf.ints.zero_()
        buf.kda_slots.fill_(-1)

    def _host_inputs(self, seqs: list[StepSeq], buf: TailBuffers) -> torch.Tensor:
        """The step's inputs as one CPU int64 tensor in TailBuffers' layout, padded to Bb rows (copies of row 0) and
        Gb pages. Validates what the trusted kernels do not check on the device: equal lengths Tn, slots distinct
        and in range, tokens in the vocabulary, every position inside its block table, page ids inside the pool."""
        B, Tn, Gb, ps = len(seqs), buf.Tn, buf.Gb, self.page_size
        if any(len(s.tokens) != Tn for s in seqs):
            raise ValueError(f"prefill-tail step: every sequence must bring {Tn} tokens (the shape's), got "
                             f"{[len(s.tokens) for s in seqs]}; run unequal lengths through ModelRunner.step")
        slots = [s.slot for s in seqs]
        if len(set(slots)) != B or not all(0 <= x < self.max_seqs for x in slots):
            raise ValueError(f"prefill-tail step: KDA slots must be distinct and in [0, {self.max_seqs}), got {slots}")
        tokens, pos, smap, src, table = [], [], [], [], []
        for n, s in enumerate(seqs):
            bt = s.block_table
            if not all(0 <= t < self.vocab for t in s.tokens):
                raise ValueError(f"prefill-tail step: a token of {s.tokens} is outside the vocabulary ({self.vocab})")
            self.check_table(bt, s.start, s.start + Tn - 1, "prefill-tail step")
            tokens += s.tokens
            pos_n = range(s.start, s.start + Tn)
            pos += pos_n
            smap += [bt[p // ps] * ps + p % ps for p in pos_n]
            src += range(n * Tn, (n + 1) * Tn)
            table += bt + [0] * (Gb - len(bt))  # pages past the sequence are masked (key > position)
        pad = buf.Bb - B
        # padded rows: row 0's tokens, positions, latent rows and sources (its values written to its places again)
        fields = [f + f[:Tn] * pad for f in (tokens, pos, smap, src)] + [[1] * (buf.Bb * Tn)]
        fields += [slots + [-1] * pad, slots + slots[:1] * pad, list(range(B)) + [0] * pad, table + table[:Gb] * pad]
        return torch.tensor([x for f in fields for x in f], dtype=torch.long)

    # ------------------------------------------------------------------------------------------------ the step

    def tail_forward(self, buf: TailBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """Tn prompt tokens per row from the static buffers: returns (logits [Bb, V_] fp32 at each row's last token,
        final hidden [N, D] before the final norm) and updates the KDA slots (final state only), conv tails and
        latent pages in place.

        Only tensor ops on the buffers: no host read, no branch on data, no allocation sized by data, so CUDA can
        capture it. Same modules and arithmetic as ModelRunner.step on equal-length tails (the shared helpers of
        k3.serve.runner), up to the summation order of masked keys."""
        live = buf.live != 0  # [N]
        x = self.model.model.embed_tokens(buf.tokens)[None]  # [1, N, D]
        hidden = self.model.model.run_layers(x, lambda i, layer, h: self._mixer(i, layer, h, buf, live))[0]  # [N, D]
        last = hidden.view(buf.Bb, buf.Tn, -1)[:, -1]  # [Bb, D] each row's last token
        return final_logits(self.model, last), hidden

    def _mixer(self, i: int, layer, x: torch.Tensor, buf: TailBuffers, live: torch.Tensor) -> torch.Tensor:
        r = self.runner
        if i in r.kda_index:
            return self._kda(r.kda_index[i], layer.self_attn, x, buf, live.view(buf.Bb, buf.Tn)[:, 0])
        # Tn queries per row; the new latents go into the pages first (each token attends to itself and its row's
        # earlier tokens, key <= position)
        return write_and_attend(layer.self_attn, r.pages.kv[r.mla_index[i]], x, buf.positions, buf.slot_mapping,
                                buf.src_tok, live, buf.block_table, buf.Tn)

    def _kda(self, li: int, attn: KimiDeltaAttention, x: torch.Tensor, buf: TailBuffers,
             live_rows: torch.Tensor) -> torch.Tensor:
        """KDA of Tn tokens per row, x [1, N, D] -> [1, N, D]; the conv tails and the working state after each row's
        last token are written in place (live_rows [Bb]: 0 = put the tails back)."""
        Bb, Tn = buf.Bb, buf.Tn
        H, K = attn.num_heads, attn.head_k_dim
        qkv = []
        for proj, conv, tail_pool in zip((attn.q_proj, attn.k_proj, attn.v_proj),
                                         (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d), self.runner.states.tails[li]):
            p = proj(x).view(Bb, Tn, -1)  # [Bb, Tn, C] pre-conv inputs
            tail0 = tail_pool[buf.tail_slots]  # [Bb, W-1, C]
            y, tail1 = causal_conv1d(p, conv.weight[:, 0], activation="silu", initial_tail=tail0,
                                     output_final_tail=True)  # [Bb, Tn, C], [Bb, W-1, C]
            tail_pool[buf.tail_slots] = torch.where(live_rows[:, None, None], tail1[buf.src_rows].to(tail_pool.dtype),
                                                    tail0)
            qkv.append(y.unflatten(-1, (H, K)))  # [Bb, Tn, H, K]
        q, k, v = qkv
        z, b = attn.gate_input(x).view(Bb, Tn, H, K), attn.b_proj(x).view(Bb, Tn, H)
        o = kda_pool_step(attn, q, k, v, z, b, self.runner.states.state[li], buf.kda_slots)  # [Bb, Tn, H, V]
        return kda_output(attn, x, o.view(1, Bb * Tn, *o.shape[2:]))
