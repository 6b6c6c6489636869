"""Fixed-shape steps of static buffers: the model's forward over the engine's pools with every index in one int64
buffer, so a CUDA graph can capture it (k3.serve.graphs replays it; without capture the same function runs eagerly).

One function, `step_forward`, serves three step types at shape (Bb rows, T tokens per row, Gb pages per row):
- "step" with T = 1: a decode step; T = 2..64: a prefill chunk (a prefix hit's tail, or a short prompt in graph
  chunks). Each row's working KDA slot gets the state after its last token, its conv tails are written;
- "verify" with T = 1 + drafts: a speculative verify step. The state after token t goes to the per-token slot
  StatePool.token_slot(slot, t); the conv tails are NOT written: the pre-conv inputs come back as outputs and the
  rollback (`commit_forward`) sets the tails and the working state to the accepted length.
`mtp_forward` runs the model's MTP block over (hidden, token) pairs the same way, and `commit_forward` rolls a
verify step back. Only tensor ops on the buffers: no host read, no branch on data, no allocation sized by data.

Padding. Rows b >= B repeat real row 0 (tokens, positions, latent rows, tail slot, block table), name no
recurrent slot (-1: start from zeros, write nothing) and write row 0's values at row 0's places (src_tok, src_rows),
so an index written twice gets the same value twice (deterministic with duplicate indices on any device) and no other
slot or page is touched. A verify row shorter than T repeats its last real token (same token, position, latent row
and src_tok) with slot -1; its outputs are dropped. An MTP row shorter than T repeats its last real pair. With live =
0 every cache write puts back what it read: the inert inputs of the warm-up runs before a capture (`fill_inert`).

Host layouts (`*_layout`) check what the trusted kernels no longer check on the device: slots distinct and in
range, tokens in the vocabulary, every position inside its block table, page ids inside the pool.

Legend: B sequences, Bb batch bucket, T tokens per row, N = Bb * T, Gb page bucket, D width, V_ vocab, W1 = conv
width - 1, C channels, X latent width.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from k3.model.cache import InferenceState, LatentGroup

from .cache import StaticKDAView, StaticLatentView

_TOKEN_FIELDS = ("tokens", "positions", "slot_mapping", "src_tok", "live", "kda_slots", "real_rows")  # [N] each
_ROW_FIELDS = ("row_slots", "tail_slots", "src_rows", "last_rows")  # [Bb] each
_PAIR_FIELDS = ("tokens", "positions", "slot_mapping", "src_tok", "live", "hid_rows")  # [N] each
_COMMIT_FIELDS = ("slots", "src", "rows", "kept", "live")  # [Bb] each


class StaticBuffers:
    """The static integer inputs of one shape: named views of one int64 buffer `ints` (a step's inputs travel in one
    host-to-device copy), plus the shape's captured graph and its static outputs."""

    def __init__(self, fields: list[tuple[str, tuple[int, ...]]], device: torch.device):
        sizes = [math.prod(shape) for _, shape in fields]
        self.ints = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        off = 0
        for (name, shape), n in zip(fields, sizes):
            setattr(self, name, self.ints[off:off + n].view(shape))
            off += n
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed = False  # capture raised: this shape runs eagerly for good
        self.compiled = False  # captured from the torch.compile'd function
        self.outputs: tuple[torch.Tensor, ...] | None = None  # static outputs of the captured graph


class StepBuffers(StaticBuffers):
    """One (kind, Bb, T, Gb) shape of step_forward, kind "step" or "verify": per token [N] tokens, positions,
    slot_mapping (flat latent row), src_tok (the token whose latent is written at this token's row), live (0 = write
    back what was read), kda_slots (verify: per-token state slot), real_rows (verify: the real tokens' rows, packed);
    per row [Bb] row_slots (step: working slot, -1 for padded rows), tail_slots (conv tails read and written),
    src_rows (the row whose tails are written at row b's slot), last_rows (each row's last real token);
    block_table [Bb, Gb]. A verify shape also holds its rollback's inputs (`commit`) and last outputs (`pre`)."""

    def __init__(self, kind: str, Bb: int, T: int, Gb: int, device: torch.device):
        N = Bb * T
        super().__init__([(f, (N,)) for f in _TOKEN_FIELDS] + [(f, (Bb,)) for f in _ROW_FIELDS]
                         + [("block_table", (Bb, Gb))], device)
        self.kind, self.Bb, self.T, self.Gb = kind, Bb, T, Gb
        self.commit = StaticBuffers([(f, (Bb,)) for f in _COMMIT_FIELDS], device) if kind == "verify" else None
        self.pre: tuple[torch.Tensor, ...] = ()


class MTPBuffers(StaticBuffers):
    """One ("mtp", Bb, T, Gb) shape: per pair [N] tokens t_j, positions (MTP slot j), slot_mapping, src_tok, live,
    hid_rows (row of the caller's hidden); out_rows [Bb] (each row's last real pair); block_table [Bb, Gb];
    hidden_in [N, D] (the pairs' h_{j-1})."""

    def __init__(self, Bb: int, T: int, Gb: int, D: int, dtype: torch.dtype, device: torch.device):
        N = Bb * T
        super().__init__([(f, (N,)) for f in _PAIR_FIELDS] + [("out_rows", (Bb,)), ("block_table", (Bb, Gb))],
                         device)
        self.kind, self.Bb, self.T, self.Gb = "mtp", Bb, T, Gb
        self.hidden_in = torch.zeros(N, D, dtype=dtype, device=device)


def fill_inert(buf: StaticBuffers) -> None:
    """Inputs whose run changes no cache: no recurrent slot named, every write puts back what it read (slot 0's
    tails, page 0's first latent row); MTP queries at slot 1 (a key min_key = 1 does not mask)."""
    buf.ints.zero_()
    if isinstance(buf, MTPBuffers):
        buf.positions.fill_(1)
    else:
        buf.row_slots.fill_(-1)
        buf.kda_slots.fill_(-1)


def commit_inert(c: StaticBuffers) -> None:
    """Rollback inputs that change nothing: slot 0's state onto itself, tails written back (live 0)."""
    c.ints.zero_()
    c.kept.fill_(1)


# ------------------------------------------------------------------------------------------------ host layouts


def _pad(rows: list, first: list, pad: int) -> list:
    """rows followed by `pad` copies of `first` (row 0's entries)."""
    return rows + first * pad


def check_table(bt: list[int], first: int, last: int, page_size: int, num_pages: int, what: str) -> None:
    """Positions first..last inside the block table, page ids inside the pool."""
    if not 0 <= first <= last < len(bt) * page_size or min(bt) < 0 or max(bt) >= num_pages:
        raise ValueError(f"{what}: positions {first}..{last} outside its {len(bt)} pages of {page_size}, or "
                         f"a page id outside [0, {num_pages}) in {bt}")


def _check_slots(slots: list[int], max_seqs: int, what: str) -> None:
    if len(set(slots)) != len(slots) or not all(0 <= x < max_seqs for x in slots):
        raise ValueError(f"{what}: KDA slots must be distinct and in [0, {max_seqs}), got {slots}")


def padded_row(s, n: int, T: int, geom, what: str) -> tuple[list[int], ...]:
    """Row n of a shape with T tokens per row from sequence s, after checking its tokens and block table: for each
    t < T the index j = min(t, L - 1) of the real token it carries (past the row's L tokens the last one repeats),
    that token, its position, its flat latent row and its src_tok row n * T + j. geom: (vocab, page size, pages).
    Returns (js, tokens, positions, slot_mapping, src_tok), [T] each."""
    vocab, ps, num_pages = geom
    L, bt = len(s.tokens), s.block_table
    if not all(0 <= t < vocab for t in s.tokens):
        raise ValueError(f"{what}: a token of {s.tokens} is outside the vocabulary ({vocab})")
    if not 1 <= L <= T:
        raise ValueError(f"{what}: sequence {n} brings {L} tokens, the shape holds 1..{T}")
    check_table(bt, s.start, s.start + L - 1, ps, num_pages, what)
    js = [min(t, L - 1) for t in range(T)]
    pos = [s.start + j for j in js]
    return js, [s.tokens[j] for j in js], pos, [bt[p // ps] * ps + p % ps for p in pos], [n * T + j for j in js]


def step_layout(seqs, buf: StepBuffers, geom, max_seqs: int, token_slot) -> torch.Tensor:
    """The inputs of `seqs` as one CPU int64 tensor in StepBuffers' layout, padded to Bb rows (copies of row 0) and
    Gb pages. "step": every sequence brings exactly T tokens; "verify": 1..T (shorter rows repeat their last token),
    per-token slots token_slot(slot, t). (Host work on every step: the per-token fields are numpy array operations,
    the per-sequence checks plain Python; 32 x 64 tokens took ~1 ms as per-token Python lists.)"""
    T, Gb, kind = buf.T, buf.Gb, buf.kind
    if kind == "verify":
        return _verify_layout(seqs, buf, geom, max_seqs, token_slot)
    vocab, ps, num_pages = geom
    slots = [s.slot for s in seqs]
    _check_slots(slots, max_seqs, "step")
    tokens, starts, table = [], [], []
    for s in seqs:
        bt, start = s.block_table, s.start
        if len(s.tokens) != T:
            raise ValueError(f"step: every sequence must bring {T} tokens (the shape's), got "
                             f"{[len(x.tokens) for x in seqs]}; run unequal lengths through the eager step")
        check_table(bt, start, start + T - 1, ps, num_pages, "step")
        tokens += s.tokens
        starts.append(start)
        table += bt
        if len(bt) < Gb:
            table += [0] * (Gb - len(bt))  # pages past the sequence are masked (key > position)
    if min(tokens) < 0 or max(tokens) >= vocab:
        raise ValueError(f"step: a token of {tokens} is outside the vocabulary ({vocab})")
    if T == 1 and buf.Bb <= 16:
        return _decode_layout(tokens, starts, slots, table, buf.Bb, Gb, ps)
    return _chunk_layout(tokens, starts, slots, table, buf.Bb, T, Gb, ps)


def _decode_layout(tokens, starts, slots, table, Bb: int, Gb: int, ps: int) -> torch.Tensor:
    """_chunk_layout at T = 1 in plain Python: a decode step's ~12 fields of <= 16 rows are cheaper as lists than as
    ~25 numpy calls (min of 5 on a loaded CPU: 14 / 59 us at one row, 69 / 85 us at 16, 116 / 69 us at 32)."""
    B = len(tokens)
    row = list(range(B)) + [0] * (Bb - B)  # the sequence each row carries: padded rows repeat row 0
    tab = [table[r * Gb:(r + 1) * Gb] for r in row]
    pos = [starts[r] for r in row]
    smap = [t[p // ps] * ps + p % ps for t, p in zip(tab, pos)]
    slot = [slots[r] for r in row]
    flat = ([tokens[r] for r in row] + pos + smap + row + [1] * Bb + [-1] * Bb + row
            + slot[:B] + [-1] * (Bb - B) + slot + row + row + [x for t in tab for x in t])
    return torch.tensor(flat, dtype=torch.long)


def _chunk_layout(tokens, starts, slots, table, Bb: int, T: int, Gb: int, ps: int) -> torch.Tensor:
    """The "step" layout of B rows of T tokens each, padded to Bb rows (the fields of StepBuffers, in its order)."""
    B, N = len(starts), Bb * T
    ar = np.arange(Bb)
    row = np.where(ar < B, ar, 0)  # [Bb] the sequence each row carries: padded rows repeat row 0
    table_BG = np.asarray(table, dtype=np.int64).reshape(B, Gb)[row]  # [Bb, Gb]
    pos_BT = np.asarray(starts, dtype=np.int64)[row][:, None] + np.arange(T)  # [Bb, T]
    smap_BT = np.take_along_axis(table_BG, pos_BT // ps, axis=1) * ps + pos_BT % ps
    src_BT = row[:, None] * T + np.arange(T)  # each token writes its own latent; padded rows row 0's
    real = np.arange(N)
    slots_a = np.asarray(slots, dtype=np.int64)
    flat = np.concatenate([
        np.asarray(tokens, dtype=np.int64).reshape(B, T)[row].ravel(), pos_BT.ravel(), smap_BT.ravel(),
        src_BT.ravel(), np.ones(N, np.int64),  # live
        np.full(N, -1, np.int64),  # kda_slots (verify only)
        np.where(real < B * T, real, 0),  # real_rows (verify only)
        np.where(ar < B, slots_a[row], -1),  # row_slots: padded rows name no recurrent slot
        slots_a[row], row, row * T + T - 1,  # tail_slots, src_rows, last_rows
        table_BG.ravel()])
    return torch.from_numpy(flat)


def _verify_layout(seqs, buf: StepBuffers, geom, max_seqs: int, token_slot) -> torch.Tensor:
    """step_layout of a verify shape: rows of 1..T tokens padded by repeating their last token (which names no KDA
    slot), per-token state slots."""
    B, T, Gb = len(seqs), buf.T, buf.Gb
    slots = [s.slot for s in seqs]
    _check_slots(slots, max_seqs, "verify step")
    tokens, pos, smap, src, kslots, real, last, table = [], [], [], [], [], [], [], []
    for n, s in enumerate(seqs):
        L = len(s.tokens)
        _, tok_n, pos_n, smap_n, src_n = padded_row(s, n, T, geom, "verify step")
        tokens += tok_n
        pos += pos_n
        smap += smap_n
        src += src_n
        kslots += [token_slot(s.slot, t) if t < L else -1 for t in range(T)]
        real += range(n * T, n * T + L)
        last.append(n * T + L - 1)
        table += s.block_table + [0] * (Gb - len(s.block_table))  # pages past the sequence are masked
    pad, N = buf.Bb - B, buf.Bb * T
    fields = [_pad(tokens, tokens[:T], pad), _pad(pos, pos[:T], pad), _pad(smap, smap[:T], pad),
              _pad(src, src[:T], pad), [1] * N, kslots + [-1] * (T * pad), real + [0] * (N - len(real)),
              slots + [-1] * pad, _pad(slots, slots[:1], pad), list(range(B)) + [0] * pad, _pad(last, last[:1], pad),
              _pad(table, table[:Gb], pad)]
    return torch.tensor([x for f in fields for x in f], dtype=torch.long)


def mtp_layout(seqs, buf: MTPBuffers, geom) -> torch.Tensor:
    """The MTP call's inputs as one CPU int64 tensor in MTPBuffers' layout: rows padded to T pairs by repeating their
    last real pair, Bb rows (copies of row 0), Gb pages; tokens and positions checked first."""
    T, Gb = buf.T, buf.Gb
    tokens, pos, smap, src, hid, out_rows, table = [], [], [], [], [], [], []
    off = 0  # packed row of the sequence's first pair in the caller's hidden
    for n, s in enumerate(seqs):
        js, tok_n, pos_n, smap_n, src_n = padded_row(s, n, T, geom, "MTP step")
        tokens += tok_n
        pos += pos_n
        smap += smap_n
        src += src_n
        hid += [off + j for j in js]
        out_rows.append(n * T + len(s.tokens) - 1)
        table += s.block_table + [0] * (Gb - len(s.block_table))
        off += len(s.tokens)
    pad = buf.Bb - len(seqs)
    fields = [_pad(f, f[:T], pad) for f in (tokens, pos, smap, src)] + [[1] * (buf.Bb * T), _pad(hid, hid[:T], pad)]
    fields += [_pad(out_rows, out_rows[:1], pad), _pad(table, table[:Gb], pad)]
    return torch.tensor([x for f in fields for x in f], dtype=torch.long)


def commit_layout(record, token_slot) -> torch.Tensor:
    """The rollback's inputs of a verify step (record.kept all set, 1 <= kept <= T_n) as one CPU int64 tensor in
    `_COMMIT_FIELDS` order; padded rows repeat row 0 (the same values written twice to row 0's slot)."""
    B, Bb = len(record.seqs), record.buf.Bb
    if not all(a is not None and 1 <= a <= len(s.tokens) for s, a in zip(record.seqs, record.kept)):
        raise ValueError(f"verify commit: accepted lengths {record.kept} must lie in 1..T_n "
                         f"{[len(s.tokens) for s in record.seqs]} (every sequence committed)")
    slots = [s.slot for s in record.seqs]
    src = [token_slot(s.slot, a - 1) for s, a in zip(record.seqs, record.kept)]
    pad = Bb - B
    fields = [_pad(slots, slots[:1], pad), _pad(src, src[:1], pad), _pad(list(range(B)), [0], pad),
              _pad(list(record.kept), record.kept[:1], pad), [1] * Bb]
    return torch.tensor([x for f in fields for x in f], dtype=torch.long)


# ------------------------------------------------------------------------------------------------ the functions


def _latent_view(kv_pool, buf, live, min_key: int = 0) -> StaticLatentView:
    group = LatentGroup(None, buf.Bb, buf.T, buf.block_table, buf.positions.view(buf.Bb, buf.T))
    return StaticLatentView(kv_pool, buf.slot_mapping, buf.positions, [group], buf.src_tok, live, min_key)


def step_forward(runner, buf: StepBuffers) -> tuple[torch.Tensor, ...]:
    """The model's forward over T tokens per row from the static buffers (module docstring). Returns "step": (logits
    [Bb, V_] fp32 at each row's last token, final hidden [N, D] before the final norm); "verify": (logits [N, V_],
    hidden [N, D], then per KDA layer and projection q, k, v: tail0 [Bb, W1, C], pre-conv inputs [N, C])."""
    model, Bb, T = runner.model, buf.Bb, buf.T
    live = buf.live != 0  # [N]
    live_rows = live.view(Bb, T)[:, 0]  # a row's tails follow its first token's flag
    verify = buf.kind == "verify"
    slots = buf.kda_slots.view(Bb, T) if verify else buf.row_slots
    pre: list[torch.Tensor] = []
    layers = []
    for i, kind in enumerate(runner.cfg.layer_types):
        if kind == "kda":
            li = runner.kda_index[i]
            layers.append(StaticKDAView(buf.kind if verify else "plain", runner.states.state[li],
                                        runner.states.tails[li], slots, buf.tail_slots, buf.src_rows, live_rows, T,
                                        pre))
        else:
            layers.append(_latent_view(runner.pages.kv[runner.mla_index[i]], buf, live))
    hidden = model.hidden_states(buf.tokens.view(Bb, T), InferenceState(layers=layers)).flatten(0, 1)  # [N, D]
    if verify:
        return (model.logits(hidden).float(), hidden, *pre)
    return model.logits(hidden.view(Bb, T, -1)[:, -1]).float(), hidden


def mtp_forward(runner, buf: MTPBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's MTP block over the static pairs: returns (output before its norm [Bb, D], fp32 logits [Bb, V_])
    at each row's out_rows pair; writes the pairs' latents into the MTP pages (keys below slot 1 masked)."""
    model, Bb, T = runner.model, buf.Bb, buf.T
    view = _latent_view(runner.pages.kv[runner.mtp_layer], buf, buf.live != 0, min_key=1)
    x = model.mtp_hidden(buf.hidden_in.view(Bb, T, -1), buf.tokens.view(Bb, T), view).flatten(0, 1)  # [N, D]
    last = x[buf.out_rows]  # [Bb, D]
    return last, model.mtp_head(last).float()


def commit_forward(runner, buf: StepBuffers) -> None:
    """Roll a verify step's rows back to their accepted lengths (buf.commit: per row working slot, state row src,
    the row whose pre-conv inputs give its tails, kept, live). Per KDA layer: state[slots] <- state[src]; each
    conv tail [slots] <- rows kept .. kept + W1 - 1 of [tail0 ; pre-conv inputs] ([Bb, W1 + T, C]) of row `rows`.
    Tensor ops only."""
    c, Bb, T = buf.commit, buf.Bb, buf.T
    live = (c.live != 0)[:, None, None]
    for li, (pool, tails) in enumerate(zip(runner.states.state, runner.states.tails)):
        pool.index_copy_(0, c.slots, pool.index_select(0, c.src))
        for j, tail_pool in enumerate(tails):
            tail0, p = buf.pre[6 * li + 2 * j], buf.pre[6 * li + 2 * j + 1]  # [Bb, W1, C], [N, C]
            W1, C = tail0.shape[1:]
            xp = torch.cat([tail0, p.view(Bb, T, C).to(tail0.dtype)], dim=1).index_select(0, c.rows)
            idx = c.kept[:, None] + torch.arange(W1, device=xp.device)  # [Bb, W1]
            new = xp.gather(1, idx[:, :, None].expand(Bb, W1, C))
            old = tail_pool.index_select(0, c.slots)
            tail_pool.index_copy_(0, c.slots, torch.where(live, new.to(tail_pool.dtype), old))
