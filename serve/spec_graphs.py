"""Speculative fast path: verify steps and MTP draft steps as fixed-shape functions of static buffers, replayed from
CUDA graphs like the plain decode steps of k3.serve.graphs (serving.md 2.4 and 2.5; issue 5). The capture
machinery, shape buckets, graph cap, memory pool and torch.compile option are graphs.StaticGraphs'.

Verify steps (`VerifyGraphs`). A step qualifies when every sequence is a verify sequence (spec, "all" logits, no
snapshot) of T_n = 1 + drafts tokens, 2 <= T_n <= 1 + spec_tokens; the lengths may differ (drafts cut near
max_tokens or max_model_len, a token budget). Other steps (a prefill or a plain decode in the batch) run
ModelRunner's eager path. Shape (Bb, T, Gb) with T = max T_n; row n holds its T_n tokens at positions
start..start+T_n-1, then T - T_n padded tokens that are inert for everything kept:
  - a padded token repeats the row's last real token (token id, position, latent row, src_tok = that token), so
    its latent write puts the identical value at the identical place (deterministic with duplicate indices; a
    live = 0 write-back there would race with the real write in the same scatter); its query attends like the last
    real token and its outputs are dropped;
  - its per-token KDA slot is -1: the kernel writes nothing there, and the real tokens' states are written before
    the recurrence reaches it;
  - its pre-conv inputs exist in the static output, but the commit reads rows < kept <= T_n only.
- KDA: the conv of each row's T pre-conv inputs starting from its working slot's tails, which are NOT written: the
  static outputs (tail0 [Bb, W-1, C], pre-conv inputs [Bb * T, C]) per KDA layer and projection are what
  `ModelRunner.commit_spec` needs to set the tails (and any snapshot at a boundary) to the accepted length. The
  recurrence runs `fused_recurrent_kda_pool_trusted` with per-token slots [Bb, T] = StatePool.token_slot(slot, t),
  exactly as the runner's eager verify path; padded rows name slot -1 (start from zeros, write nothing).
- MLA: the latents of all T tokens go into the pages, then `paged_mla_decode` with T queries per row.
- Outputs: logits [Bb * T, V_] fp32 and the final hidden [Bb * T, D] (padded layout, row n at n * T). The
  StepOutput is the eager path's: logits[n] [T_n, V_], hidden [sum T_n, D] of the real rows packed (gathered with
  the static `real_rows`), cu the packed offsets. The runner keeps (sequences, padded offsets n * T, padded hidden,
  pre-conv inputs) as its `_last` for commit_spec, which writes any snapshot at once (from the per-token states
  and the pre-conv inputs, as on the eager path; it reads rows < kept <= T_n of each row) and collects the accepted
  lengths; once every sequence of the step has one, `VerifyGraphs.commit` sets all working states and conv tails in
  one batched call (a second small graph per verify shape) instead of ~7 small ops per KDA layer and sequence.

MTP draft steps (`MTPGraphs`, runner.mtp_step). The recursive drafts bring one pair per sequence, the catch-up call
1..k+2 pairs (the committed tokens and the first draft pair). Shape (Bb, T, Gb) with T = the longest row; a
shorter row is padded by repeating its last real pair (same token, MTP slot and hidden row): the repeated pair's
latent is the value its last real pair writes to the same place (the MTP is NoPE and stateless, and the write takes
the last real pair's row), so a write repeated is harmless; each row's output is read at its last real pair. The
hidden rows travel through one static [Bb * T, D] buffer (an index_select from the caller's packed rows before the
replay). Keys below 1 are masked (min_key = 1: slot 0 holds no pair), as in the eager call.

Padding rows b >= B copy real row 0 (tokens, positions, slots, block table), write row 0's values at row 0's
targets, and name no recurrent slot, as in graphs.py; inert runs (warm-up before a capture) write back what they
read. Outputs are cloned after a replay, except the verify step's pre-conv inputs, which commit_spec reads before
the next step (the next replay of the same shape).

Legend: B sequences, Bb batch bucket, T tokens (pairs) per row, N = Bb * T, Gb page bucket, D width, V_ vocab,
H heads, K head dim, C channels, W conv kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.kernels.conv import causal_conv1d
from k3.model.kda import KimiDeltaAttention

from .graphs import COMMON_BATCHES, MAX_GRAPHS, GraphBudget, StaticBuffers, StaticGraphs, bucket, write_and_attend
from .runner import ModelRunner, StepOutput, StepSeq, final_logits, kda_output, kda_pool_step

_TOKEN_FIELDS = ("tokens", "kda_slots", "positions", "slot_mapping", "src_tok", "live", "real_rows")  # [N] each
_PAIR_FIELDS = ("tokens", "positions", "slot_mapping", "src_tok", "live", "hid_rows")  # [N] each
_COMMIT_FIELDS = ("slots", "src", "rows", "kept", "live")  # [Bb] each


class VerifyBuffers(StaticBuffers):
    """Static inputs of one verify shape (Bb, T, Gb), views of one int64 buffer: per token [N] tokens, kda_slots
    (per-token state slot, -1 for padded tokens and rows), positions, slot_mapping (flat latent row), src_tok (the
    token whose latent is written at this token's row), live (0 = write back what was read), real_rows (the real
    tokens' rows, packed, then zeros: gathers the StepOutput's hidden); per row tail_slots [Bb] (conv tails read),
    last_rows [Bb] (each row's last real token); block_table [Bb, Gb]. `commit`: the static inputs of the shape's
    commit function (per row [Bb]: working slot, the state row to copy into it, the row whose conv inputs give its
    tails, accepted tokens, live); `pre`: the last step's (tail0, pre-conv inputs) per KDA layer and projection,
    which the commit reads."""

    def __init__(self, Bb: int, T: int, Gb: int, device: torch.device):
        N = Bb * T
        super().__init__([(name, (N,)) for name in _TOKEN_FIELDS] + [("tail_slots", (Bb,)), ("last_rows", (Bb,)),
                                                                      ("block_table", (Bb, Gb))], device)
        self.Bb, self.T, self.Gb = Bb, T, Gb
        self.commit = StaticBuffers([(name, (Bb,)) for name in _COMMIT_FIELDS], device)
        self.pre: tuple[torch.Tensor, ...] = ()


class MTPBuffers(StaticBuffers):
    """Static inputs of one MTP shape (Bb, T, Gb): per pair [N] tokens t_j, positions (MTP slot j), slot_mapping,
    src_tok (the pair whose latent is written at this pair's row), live, hid_rows (row of the caller's hidden);
    out_rows [Bb] (each row's last real pair); block_table [Bb, Gb]; hidden_in [N, D] (the pairs' h_{j-1})."""

    def __init__(self, Bb: int, T: int, Gb: int, D: int, dtype: torch.dtype, device: torch.device):
        N = Bb * T
        super().__init__([(name, (N,)) for name in _PAIR_FIELDS] + [("out_rows", (Bb,)),
                                                                     ("block_table", (Bb, Gb))], device)
        self.Bb, self.T, self.Gb = Bb, T, Gb
        self.hidden_in = torch.zeros(N, D, dtype=dtype, device=device)


@dataclass
class VerifyBatch:
    """The context commit_spec reads from a verify step that ran through the graphs (as the eager _StepContext),
    plus the accepted lengths it collects: once every sequence has one, VerifyGraphs.commit sets them all."""

    seqs: list[StepSeq]
    cu: list[int]  # [B + 1] row offsets in the padded layout (n * T): row n's first T_n rows are real
    buf: VerifyBuffers
    kept: list[int | None]  # [B] accepted tokens per sequence, None until commit_spec names it


def _pad(rows: list, first: list, pad: int) -> list:
    """rows followed by `pad` copies of `first` (row 0's entries)."""
    return rows + first * pad


def _padded_row(g: StaticGraphs, s: StepSeq, n: int, T: int, what: str) -> tuple[list[int], ...]:
    """Row n of a (Bb, T, Gb) shape from sequence s, after checking its tokens (vocabulary) and block table: for each
    position t < T the index j = min(t, L - 1) of the real token it carries (past the row's L tokens the last one
    repeats, so its latent write puts the same value at the same place), that token, its position, its flat latent
    row and its src_tok row n * T + j. Returns (js, tokens, positions, slot_mapping, src_tok), [T] each."""
    L, bt, ps = len(s.tokens), s.block_table, g.page_size
    if not all(0 <= t < g.vocab for t in s.tokens):
        raise ValueError(f"{what}: a token of {s.tokens} is outside the vocabulary ({g.vocab})")
    g.check_table(bt, s.start, s.start + L - 1, what)
    js = [min(t, L - 1) for t in range(T)]
    pos = [s.start + j for j in js]
    return (js, [s.tokens[j] for j in js], pos, [bt[p // ps] * ps + p % ps for p in pos], [n * T + j for j in js])


class VerifyGraphs(StaticGraphs):
    """Verify steps of a ModelRunner: `accepts(seqs)`, then `step(seqs)` -> (StepOutput, commit context) or None."""

    kind = "verify"

    def __init__(self, runner: ModelRunner, max_pages: int, capture: bool, max_graphs: int = MAX_GRAPHS,
                 compile: bool = False, budget: GraphBudget | None = None):
        """Arguments as graphs.DecodeGraphs; the runner's state pool must hold speculative scratch states."""
        super().__init__(runner, self.verify_forward, max_pages, capture, max_graphs, compile, budget)
        self.spec_tokens = runner.states.spec_tokens
        self.post = None  # k3.serve.spec_fused.PostVerifyGraphs (the one-sync step's post-verify graphs), on first use
        if self.spec_tokens < 1:
            raise ValueError("verify graphs need a state pool with speculative scratch states (spec_tokens >= 1)")

    def accepts(self, seqs: list[StepSeq]) -> bool:
        """True when every sequence verifies T_n = 1 + drafts tokens (2 <= T_n <= 1 + spec_tokens; lengths may
        differ) with "all" logits and no snapshot to write."""
        return 0 < len(seqs) <= self.max_seqs and all(
            s.spec and s.logits == "all" and not s.snapshots and 2 <= len(s.tokens) <= 1 + self.spec_tokens
            for s in seqs)

    @torch.no_grad()
    def step(self, seqs: list[StepSeq]) -> tuple[StepOutput, tuple] | None:
        """Run one verify step: per-token KDA states into the scratch slots, latents into the pages (the conv tails
        are left to commit_spec). Returns (StepOutput as ModelRunner.step gives for it, the runner's `_last` for
        commit_spec), or None when this shape must run the eager path. Rows are padded to T = max T_n; the
        StepOutput holds the real rows only, packed as the eager path's (logits[n] [T_n, V_], hidden [sum T_n, D],
        cu)."""
        lens = [len(s.tokens) for s in seqs]  # [B] T_n
        B, T = len(seqs), max(lens)
        buf = self.buffers_for(seqs, T)
        if buf is None:
            return None
        outs = self.launch(seqs, buf)
        logits, hidden_pad = outs[0][:B * T], outs[1]  # [B * T, V_], [Bb * T, D] padded layout (row n at n * T)
        if self.capture:
            logits = logits.clone()  # the static outputs get overwritten by the next replay
        cu = [0]
        for L in lens:
            cu.append(cu[-1] + L)
        # gathers (new tensors, so no clone): the real rows packed as on the eager path, each row's last real token
        out = StepOutput(logits=[logits[n * T:n * T + L] for n, L in enumerate(lens)],
                         hidden_last=hidden_pad.index_select(0, buf.last_rows[:B]),
                         hidden=hidden_pad.index_select(0, buf.real_rows[:cu[-1]]), cu=cu)
        return out, self.last_context(seqs, buf, outs)

    def launch(self, seqs: list[StepSeq], buf: VerifyBuffers) -> tuple[torch.Tensor, ...]:
        """The verify forward of `seqs` on the shape `buf` (from buffers_for): host inputs copied in, graph replayed
        (or the function run eagerly); sets buf.pre. Returns verify_forward's outputs (static when captured)."""
        outs = self._launch(buf, self._host_inputs(seqs, buf))
        buf.pre = outs[2:]
        return outs

    def last_context(self, seqs: list[StepSeq], buf: VerifyBuffers, outs: tuple[torch.Tensor, ...]) -> tuple:
        """The runner's `_last` after a verify forward of `seqs` on `buf` (outputs `outs`): commit_spec reads the
        padded layout before the next step (as buf.pre): offsets n * T, the padded hidden, the pre-conv inputs."""
        B, T = len(seqs), buf.T
        pre = {li: [(outs[2 + 6 * li + 2 * c], outs[3 + 6 * li + 2 * c]) for c in range(3)]
               for li in range(len(self.runner.states.state))}
        return VerifyBatch(seqs, list(range(0, B * T + 1, T)), buf, [None] * B), outs[1], pre

    @torch.no_grad()
    def commit(self, batch: VerifyBatch, prepare=None) -> None:
        """Roll every sequence of a graph verify step back to its own accepted length (batch.kept, all set, 1 <= kept
        <= T_n) in one call: working state <- the per-token state after token kept - 1, conv tails <- the last W-1
        pre-conv inputs up to it, real rows only (what ModelRunner.commit_spec does per sequence on the eager path,
        ~7 small ops per KDA layer). On CUDA a graph per verify shape, captured on first use (beyond the graph cap
        or if capture fails: the same function eagerly). `prepare()` runs after the host inputs are copied in and
        before the commit runs: k3.serve.spec_fast writes the accepted lengths (and src) there by device ops."""
        buf = batch.buf
        c = buf.commit
        host = self._commit_inputs(batch)
        if self.capture and buf.graph is not None and c.graph is None and not c.failed \
                and self.budget.used < self.budget.max_graphs:
            self._capture(c, (buf.Bb, buf.T, buf.Gb, "commit"), lambda _: self.commit_forward(buf),
                          self._commit_inert)
        if c.graph is not None:
            c.ints.copy_(host.pin_memory(), non_blocking=True)
            if prepare is not None:
                prepare()
            c.graph.replay()
        else:
            c.ints.copy_(host)
            if prepare is not None:
                prepare()
            self.commit_forward(buf)

    def _commit_inputs(self, batch: VerifyBatch) -> torch.Tensor:
        """The commit's inputs as one CPU int64 tensor in `_COMMIT_FIELDS` order; padded rows repeat row 0 (the same
        values written twice to row 0's slot)."""
        B, Bb = len(batch.seqs), batch.buf.Bb
        if not all(a is not None and 1 <= a <= len(s.tokens) for s, a in zip(batch.seqs, batch.kept)):
            raise ValueError(f"verify commit: accepted lengths {batch.kept} must lie in 1..T_n "
                             f"{[len(s.tokens) for s in batch.seqs]} (every sequence committed)")
        slots = [s.slot for s in batch.seqs]
        src = [self.runner.states.token_slot(s.slot, a - 1) for s, a in zip(batch.seqs, batch.kept)]
        pad = Bb - B
        fields = [_pad(slots, slots[:1], pad), _pad(src, src[:1], pad), _pad(list(range(B)), [0], pad),
                  _pad(list(batch.kept), batch.kept[:1], pad), [1] * Bb]
        return torch.tensor([x for f in fields for x in f], dtype=torch.long)

    @staticmethod
    def _commit_inert(c: StaticBuffers) -> None:
        """Commit inputs that change nothing: slot 0's state onto itself, tails written back (live 0)."""
        c.ints.zero_()
        c.kept.fill_(1)

    def commit_forward(self, buf: VerifyBuffers) -> None:
        """Per KDA layer: state[slots] <- state[src]; each conv tail [slots] <- rows kept .. kept + W-2 of
        [tail0 ; pre-conv inputs] ([Bb, W-1 + T, C]) of row `rows` (the tail after `kept` tokens). Tensor ops only."""
        c, Bb, T = buf.commit, buf.Bb, buf.T
        live = (c.live != 0)[:, None, None]
        for li, (pool, tails) in enumerate(zip(self.runner.states.state, self.runner.states.tails)):
            pool.index_copy_(0, c.slots, pool.index_select(0, c.src))
            for j, tail_pool in enumerate(tails):
                tail0, p = buf.pre[6 * li + 2 * j], buf.pre[6 * li + 2 * j + 1]  # [Bb, W-1, C], [N, C]
                W1, C = tail0.shape[1:]
                xp = torch.cat([tail0, p.view(Bb, T, C).to(tail0.dtype)], dim=1).index_select(0, c.rows)
                idx = c.kept[:, None] + torch.arange(W1, device=xp.device)  # [Bb, W-1]
                new = xp.gather(1, idx[:, :, None].expand(Bb, W1, C))
                old = tail_pool.index_select(0, c.slots)
                tail_pool.index_copy_(0, c.slots, torch.where(live, new.to(tail_pool.dtype), old))

    def capture_common(self, batches=COMMON_BATCHES) -> None:
        """Capture T = 1 + spec_tokens (every draft proposed) for the buckets of `batches` (warmup)."""
        if self.capture:
            for Bb in batches:
                if Bb <= self.max_seqs:
                    self._warm(bucket(Bb, self.max_seqs), 1 + self.spec_tokens, self.page_bucket(1))

    def new_buffers(self, Bb: int, T: int, Gb: int) -> VerifyBuffers:
        return VerifyBuffers(Bb, T, Gb, self.runner.device)

    def fill_inert(self, buf: VerifyBuffers) -> None:
        """No recurrent slot named, every latent write puts back what it read; tails are never written here."""
        buf.ints.zero_()
        buf.kda_slots.fill_(-1)

    def _host_inputs(self, seqs: list[StepSeq], buf: VerifyBuffers) -> torch.Tensor:
        """The step's inputs as one CPU int64 tensor in VerifyBuffers' layout: row n's T_n real tokens, then T - T_n
        copies of its last real token (same token, position, latent row and src_tok, so the repeated write puts the
        same value at the same place) that name no KDA slot; Bb rows (copies of row 0) and Gb pages. The real
        tokens pass the checks the trusted kernels no longer make first (slots distinct and in range, tokens in the
        vocabulary, positions inside the block table, page ids inside the pool)."""
        B, T, Gb = len(seqs), buf.T, buf.Gb
        slots = [s.slot for s in seqs]
        if len(set(slots)) != B or not all(0 <= x < self.max_seqs for x in slots):
            raise ValueError(f"verify step: KDA slots must be distinct and in [0, {self.max_seqs}), got {slots}")
        tokens, kslots, pos, smap, src, real, last, table = [], [], [], [], [], [], [], []
        for n, s in enumerate(seqs):
            L, bt = len(s.tokens), s.block_table
            if not 1 <= L <= T:
                raise ValueError(f"verify step: sequence {n} brings {L} tokens, the shape holds 1..{T}")
            _, tok_n, pos_n, smap_n, src_n = _padded_row(self, s, n, T, "verify step")
            tokens += tok_n
            pos += pos_n
            smap += smap_n
            src += src_n
            kslots += [self.runner.states.token_slot(s.slot, t) if t < L else -1 for t in range(T)]
            real += range(n * T, n * T + L)
            last.append(n * T + L - 1)
            table += bt + [0] * (Gb - len(bt))  # pages past the sequence are masked (key > position)
        pad, N = buf.Bb - B, buf.Bb * T
        fields = [_pad(tokens, tokens[:T], pad), kslots + [-1] * (T * pad), _pad(pos, pos[:T], pad),
                  _pad(smap, smap[:T], pad), _pad(src, src[:T], pad), [1] * N, real + [0] * (N - len(real)),
                  _pad(slots, slots[:1], pad), _pad(last, last[:1], pad), _pad(table, table[:Gb], pad)]
        return torch.tensor([x for f in fields for x in f], dtype=torch.long)

    def verify_forward(self, buf: VerifyBuffers) -> tuple[torch.Tensor, ...]:
        """T tokens per row from the static buffers: returns (logits [N, V_] fp32, final hidden [N, D], then per KDA
        layer and projection q, k, v: tail0 [Bb, W-1, C], pre-conv inputs [N, C]); writes the per-token KDA states
        and the latents. Only tensor ops on the buffers (capturable), same arithmetic as ModelRunner's verify step."""
        live = buf.live != 0  # [N]
        pre: list[torch.Tensor] = []
        x = self.model.model.embed_tokens(buf.tokens)[None]  # [1, N, D]
        hidden = self.model.model.run_layers(x, lambda i, layer, h: self._mixer(i, layer, h, buf, live, pre))[0]
        return (final_logits(self.model, hidden), hidden, *pre)

    def _mixer(self, i, layer, x, buf: VerifyBuffers, live, pre) -> torch.Tensor:
        r = self.runner
        if i in r.kda_index:
            return self._kda(r.kda_index[i], layer.self_attn, x, buf, pre)
        return write_and_attend(layer.self_attn, r.pages.kv[r.mla_index[i]], x, buf.positions, buf.slot_mapping,
                                buf.src_tok, live, buf.block_table, buf.T)

    def _kda(self, li: int, attn: KimiDeltaAttention, x: torch.Tensor, buf: VerifyBuffers,
             pre: list[torch.Tensor]) -> torch.Tensor:
        """KDA of T tokens per row, x [1, N, D] -> [1, N, D]: state after token t into kda_slots[b, t]; the conv
        tails are read, not written (appends this layer's (tail0, pre-conv inputs) pairs to `pre`)."""
        Bb, T = buf.Bb, buf.T
        H, K = attn.num_heads, attn.head_k_dim
        qkv = []
        for proj, conv, tail_pool in zip((attn.q_proj, attn.k_proj, attn.v_proj),
                                         (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d), self.runner.states.tails[li]):
            p = proj(x)[0]  # [N, C] pre-conv inputs
            tail0 = tail_pool[buf.tail_slots]  # [Bb, W-1, C]
            y, _ = causal_conv1d(p.view(Bb, T, -1), conv.weight[:, 0], activation="silu", initial_tail=tail0)
            qkv.append(y.unflatten(-1, (H, K)))  # [Bb, T, H, K]
            pre += [tail0, p]
        q, k, v = qkv
        z, b = attn.gate_input(x).view(Bb, T, H, K), attn.b_proj(x).view(Bb, T, H)
        o = kda_pool_step(attn, q, k, v, z, b, self.runner.states.state[li], buf.kda_slots.view(Bb, T))  # [Bb, T, H, V]
        return kda_output(attn, x, o.view(1, Bb * T, *o.shape[2:]))


class MTPGraphs(StaticGraphs):
    """MTP draft steps of a ModelRunner: `accepts(seqs)`, then `step(seqs, hidden)` -> (x [B, D], logits [B, V_])
    or None (eager)."""

    kind = "MTP draft"

    def __init__(self, runner: ModelRunner, max_pages: int, capture: bool, max_graphs: int = MAX_GRAPHS,
                 compile: bool = False, budget: GraphBudget | None = None):
        """Arguments as graphs.DecodeGraphs; the runner's model needs an MTP head and its page pool the MTP layer."""
        if runner.model.mtp is None or len(runner.pages.kv) <= runner.mtp_layer:
            raise ValueError("MTP graphs need a model with an MTP head and a page pool with its latent layer")
        super().__init__(runner, self.mtp_forward, max_pages, capture, max_graphs, compile, budget)
        self.max_pairs = runner.states.spec_tokens + 2  # the catch-up after a verify step: kept + 1 <= k + 2 pairs
        self.hidden_dim, self.dtype = runner.cfg.d_model, next(runner.model.parameters()).dtype

    def accepts(self, seqs: list[StepSeq]) -> bool:
        """True for 1..max_pairs pairs per sequence (the catch-up after a prefill chunk runs eagerly)."""
        return 0 < len(seqs) <= self.max_seqs and all(1 <= len(s.tokens) <= self.max_pairs for s in seqs)

    @torch.no_grad()
    def step(self, seqs: list[StepSeq], hidden_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """runner.mtp_step through the graphs: pairs (hidden_TD rows, seqs[n].tokens) at MTP slots start.. ; returns
        (pre-norm MTP output [B, D], fp32 logits [B, V_]) at each sequence's last pair, or None (eager)."""
        B, T = len(seqs), max(len(s.tokens) for s in seqs)
        if hidden_TD.shape != (sum(len(s.tokens) for s in seqs), self.hidden_dim):
            raise ValueError(f"MTP step: hidden must be [{sum(len(s.tokens) for s in seqs)}, {self.hidden_dim}] "
                             f"(one row per pair), got {tuple(hidden_TD.shape)}")
        buf = self.buffers_for(seqs, T)
        if buf is None:
            return None
        host = self._host_inputs(seqs, buf)
        h = hidden_TD.to(self.dtype)
        x, logits = (t[:B] for t in self._launch(
            buf, host, lambda: torch.index_select(h, 0, buf.hid_rows, out=buf.hidden_in)))
        if self.capture:
            x, logits = x.clone(), logits.clone()
        return x, logits

    def capture_common(self, batches=COMMON_BATCHES) -> None:
        """Capture every T = 1 .. max_pairs for the buckets of `batches` (warmup): at batch 1 each acceptance
        length gives its own catch-up length."""
        if self.capture:
            for Bb in batches:
                if Bb <= self.max_seqs:
                    for T in range(1, self.max_pairs + 1):
                        self._warm(bucket(Bb, self.max_seqs), T, self.page_bucket(1))

    def new_buffers(self, Bb: int, T: int, Gb: int) -> MTPBuffers:
        return MTPBuffers(Bb, T, Gb, self.hidden_dim, self.dtype, self.runner.device)

    def fill_inert(self, buf: MTPBuffers) -> None:
        """Every latent write puts back what it read; queries at slot 1 (a key not masked by min_key = 1)."""
        buf.ints.zero_()
        buf.positions.fill_(1)

    def _host_inputs(self, seqs: list[StepSeq], buf: MTPBuffers) -> torch.Tensor:
        """The call's inputs as one CPU int64 tensor in MTPBuffers' layout: rows padded to T pairs by repeating their
        last real pair, Bb rows (copies of row 0), Gb pages; tokens and positions checked first."""
        T, Gb = buf.T, buf.Gb
        tokens, pos, smap, src, hid, out_rows, table = [], [], [], [], [], [], []
        off = 0  # packed row of the sequence's first pair in the caller's hidden
        for n, s in enumerate(seqs):
            L, bt = len(s.tokens), s.block_table
            js, tok_n, pos_n, smap_n, src_n = _padded_row(self, s, n, T, "MTP step")
            tokens += tok_n
            pos += pos_n
            smap += smap_n
            src += src_n
            hid += [off + j for j in js]
            out_rows.append(n * T + L - 1)
            table += bt + [0] * (Gb - len(bt))
            off += L
        pad = buf.Bb - len(seqs)
        fields = [_pad(f, f[:T], pad) for f in (tokens, pos, smap, src)] + [[1] * (buf.Bb * T),
                                                                            _pad(hid, hid[:T], pad)]
        fields += [_pad(out_rows, out_rows[:1], pad), _pad(table, table[:Gb], pad)]
        return torch.tensor([x for f in fields for x in f], dtype=torch.long)

    def mtp_forward(self, buf: MTPBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP module over the static pairs (same equations as ModelRunner.mtp_step): returns (pre-norm output
        [Bb, D], fp32 logits [Bb, V_]) at each row's out_rows pair; writes the pairs' latents into the MTP pages."""
        mtp, r = self.model.mtp, self.runner
        emb = self.model.model.embed_tokens(buf.tokens)  # [N, D]
        x = mtp.eh_proj(torch.cat([mtp.hnorm(buf.hidden_in), mtp.enorm(emb)], dim=-1))[None]  # [1, N, D]
        x = x + write_and_attend(mtp.self_attn, r.pages.kv[r.mtp_layer], mtp.input_layernorm(x), buf.positions,
                                 buf.slot_mapping, buf.src_tok, buf.live != 0, buf.block_table, buf.T, min_key=1)
        x = x + mtp.mlp(mtp.post_attention_layernorm(x))
        last = x[0, buf.out_rows]  # [Bb, D]
        return last, self.model.lm_head(mtp.norm(last)).float()
