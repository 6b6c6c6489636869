"""The engine's cache views: k3.model.cache's KDA-state and latent views over the paged pools (k3.serve.pools).

The runner builds one view per layer and step from index tensors it made on the host, and calls the model's own
forward with them; the views say where the model's results go (conv tails, recurrent states, latents, prefix-cache
snapshots), never how they are computed.

- `PoolKDAView`: an eager step. Sequence n reads and writes working slot slots[n] (state and conv tails); packed
  varlen or [N, Tn] rows; with a snapshot plan it writes every snapshot of the step after the recurrence, with a
  fixed number of tensor ops per layer however many block boundaries the step crosses (`write_snapshots`).
- `StaticKDAView`: a fixed-shape step of static buffers (CUDA-graph capturable: tensor ops only, no host reads).
  "plain": row b writes the tails of row src_rows[b] at tail_slots[b] (padded rows repeat row 0, so an index
  written twice gets one value; live = 0 puts back what was read: the inert warm-up before a capture); "verify":
  per-token state slots, tails NOT written, the pre-conv inputs kept for the rollback (`pre`).
- `StaticLatentView`: token i writes the latent of token src[i] at its slot, or puts back what was there where
  live[i] is 0 (padding and inert runs write values that are already there).

Why the snapshot table: an eager step on a GPU is host-bound (~10-15 us of Python and launch per tensor op). Written
one boundary at a time, a 2048-token k3-small prefill issued ~11,000 tensor ops for its snapshots (counted on a CPU
with a TorchFunctionMode, 2026-11-29), about 3x the rest of the step; listed once per step on the host and
gathered / scattered per layer it is ~15 ops.

Legend: N sequences, T packed tokens, S snapshots written this step, W1 = conv width - 1, C conv channels, NC chunks
of the KDA chunk kernel call, H heads, K = V head dim, D width, Bb rows of a static step, X latent width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.model.cache import KDAStateView, PagedLatentView

from .pools import SnapshotStore


def to_device(parts: dict[str, list[int]], device) -> dict[str, torch.Tensor]:
    """Named int64 lists -> 1-D device tensors (views of one buffer), in ONE copy.

    A `torch.tensor(list, device="cuda")` is a blocking copy that waits for the queued GPU work; here the host buffer
    is pinned on CUDA and copied without blocking (the caching host allocator keeps it alive until the copy ran)."""
    flat, spans = [], {}
    for name, vals in parts.items():
        spans[name] = (len(flat), len(flat) + len(vals))
        flat += vals
    host = torch.tensor(flat, dtype=torch.long)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    dev_t = host.to(device, non_blocking=True)
    return {name: dev_t[a:b] for name, (a, b) in spans.items()}


@dataclass(eq=False)
class SnapshotPlan:
    """The snapshots one eager step writes (`snapshot_table`'s device lists): entries [S], state rows [S] of the pool
    (boundary at the step's end) or of cat(chunk states, final states) (`chunk_rows`), conv-tail rows [S * W1]."""

    snaps: SnapshotStore
    entries: torch.Tensor
    pool_rows: torch.Tensor
    chunk_rows: torch.Tensor
    tail_rows: torch.Tensor


class PoolKDAView(KDAStateView):
    """One KDA layer of an eager step over the StatePool (module docstring)."""

    trusted = True  # slots and offsets were built and checked on the host by the runner

    def __init__(self, state: torch.Tensor, tails: tuple, slots: torch.Tensor, *, layer: int,
                 cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: list[int] | None, max_len: int,
                 allow_recurrent: bool, plan: SnapshotPlan | None):
        self.state, self.tails, self.slots, self.layer = state, tails, slots, layer
        self.cu_seqlens, self.cu_seqlens_cpu, self.max_len = cu_seqlens, cu_seqlens_cpu, max_len
        # the chunk kernel's states in fp32 (its h_fp32 form), whether or not a boundary needs them
        self.allow_recurrent, self.chunk_states = allow_recurrent, True
        self.plan, self._pre = plan, None

    def conv_tails(self) -> tuple:
        return tuple(t[self.slots] for t in self.tails)  # [N, W1, C] each

    def conv_done(self, tails0: tuple, tails1: tuple, pre: list[torch.Tensor]) -> None:
        for pool, t1 in zip(self.tails, tails1):
            pool[self.slots] = t1.to(pool.dtype)
        if self.plan is not None:
            self._pre = [(t0, p.flatten(0, 1)) for t0, p in zip(tails0, pre)]  # [N, W1, C], [T, C]

    def state_done(self, final: torch.Tensor | None, chunk_states: torch.Tensor | None) -> None:
        if self.plan is None:
            return
        p = self.plan
        if chunk_states is None:  # recurrent: the boundary states are the pool rows the step left
            src, rows = self.state, p.pool_rows
        else:
            src, rows = torch.cat([chunk_states.flatten(0, 1), final]), p.chunk_rows
        write_snapshots(p.snaps, self.layer, p.entries, src, rows, p.tail_rows, self._pre)


class StaticKDAView(KDAStateView):
    """One KDA layer of a static step (module docstring). slots: [Bb] working slots ("plain", -1 for padded rows) or
    [Bb, T] per-token slots ("verify"); tail_slots / src_rows / live_rows [Bb]; `pre` collects the verify step's
    (tail0 [Bb, W1, C], pre-conv inputs [Bb * T, C]) per projection."""

    trusted = True  # the host layouts were checked before the copy into the buffers

    def __init__(self, mode: str, state: torch.Tensor, tails: tuple, slots: torch.Tensor, tail_slots: torch.Tensor,
                 src_rows: torch.Tensor, live_rows: torch.Tensor, max_len: int, pre: list | None = None):
        self.mode, self.state, self.tails, self.slots = mode, state, tails, slots
        self.tail_slots, self.src_rows, self.live_rows = tail_slots, src_rows, live_rows
        self.max_len, self.pre = max_len, pre

    def conv_tails(self) -> tuple:
        return tuple(t[self.tail_slots] for t in self.tails)

    def conv_done(self, tails0: tuple, tails1: tuple, pre: list[torch.Tensor]) -> None:
        if self.mode == "verify":  # the rollback sets the tails once the accepted length is known
            for t0, p in zip(tails0, pre):
                self.pre += [t0, p.flatten(0, 1)]
            return
        live = self.live_rows[:, None, None]
        for pool, t0, t1 in zip(self.tails, tails0, tails1):
            pool[self.tail_slots] = torch.where(live, t1[self.src_rows].to(pool.dtype), t0)


class StaticLatentView(PagedLatentView):
    """PagedLatentView of a static step: token i writes token src[i]'s latent, or puts back the old value where
    live[i] is 0 (module docstring)."""

    def __init__(self, kv_pool, slot_mapping, positions, groups, src: torch.Tensor, live: torch.Tensor,
                 min_key: int = 0):
        super().__init__(kv_pool, slot_mapping, positions, groups, min_key)
        self.src, self.live = src, live

    def write(self, latent_NX: torch.Tensor) -> None:
        flat = self.kv_pool.view(-1, self.kv_pool.shape[-1])
        old = flat[self.slot_mapping]
        flat[self.slot_mapping] = torch.where(self.live[:, None], latent_NX[self.src].to(flat.dtype), old)


# ---------------------------------------------------------------------------------------------------- snapshots


def snapshot_table(seqs, cu: list[int], W1: int, chunk_size: int) -> dict[str, list[int]]:
    """The host lists of an eager step's snapshots (`StepSeq.snapshots`: boundary p, reserved entry), in sequence
    order:

    snap_entry [S]: snapshot store entries (distinct: each was reserved for its own block hash this step);
    snap_hidden [S]: packed row of the token before the boundary (the MTP drafter's hidden, speculation only);
    snap_tail [S * W1]: rows of cat([pre-conv inputs [T, C], initial tails [N * W1, C]]) holding the last W1 conv
      inputs at the boundary: row r of sequence n's history [tail0[n] ; its Tn inputs] is T + n * W1 + r for
      r < W1, else cu[n] + r - W1;
    snap_slot [S]: the KDA pool slot whose state after the step is the boundary state (boundary = end of the step);
    snap_chunk [S]: row of cat([chunk states [NC, ...], final states [N, ...]]) of the chunk kernel call over the
      step's sequences: the state entering chunk j / chunk_size for an interior boundary (a chunk boundary, since
      prefill chunks start block-aligned), the sequence's final state at the end.
    Empty lists when no sequence writes a snapshot."""
    T = cu[-1]
    total_chunks = sum(-(-len(s.tokens) // chunk_size) for s in seqs)
    out = {"snap_entry": [], "snap_hidden": [], "snap_tail": [], "snap_slot": [], "snap_chunk": []}
    chunk_off = 0
    for n, s in enumerate(seqs):
        Tn = len(s.tokens)
        for p, entry in s.snapshots:
            j = p - s.start  # tokens of this step consumed at the boundary, 1..Tn
            out["snap_entry"].append(entry)
            out["snap_hidden"].append(cu[n] + j - 1)
            out["snap_tail"] += [T + n * W1 + r if r < W1 else cu[n] + r - W1 for r in range(j, j + W1)]
            out["snap_slot"].append(s.slot)
            out["snap_chunk"].append(total_chunks + n if j == Tn else chunk_off + j // chunk_size)
        chunk_off += -(-Tn // chunk_size)
    if len(set(out["snap_entry"])) != len(out["snap_entry"]):  # index_copy_ needs distinct rows to be deterministic
        raise RuntimeError(f"step: two snapshots share a store entry: {out['snap_entry']}")
    return out


def write_snapshots(snaps: SnapshotStore, layer: int, entries: torch.Tensor, state_src: torch.Tensor,
                    state_rows: torch.Tensor, tail_rows: torch.Tensor, pre) -> None:
    """Write one KDA layer's snapshots of a step into their reserved entries, as fp32: entries [S]; state_src
    [R, H, K, V] and state_rows [S] (the boundary states: snap_slot rows of the pool or snap_chunk rows of the chunk
    call's states); tail_rows [S * W1] (snap_tail); pre: per conv (q, k, v) the initial tails [N, W1, C] and the
    pre-conv inputs [T, C] of all packed tokens. Same values as writing each snapshot with SnapshotStore.write."""
    S = entries.shape[0]
    snaps.state[layer].index_copy_(0, entries, state_src.index_select(0, state_rows).to(snaps.state[layer].dtype))
    for dst, (tail0, p_TC) in zip(snaps.tails[layer], pre):
        buf = torch.cat([p_TC.to(tail0.dtype), tail0.flatten(0, 1)])  # [T + N * W1, C]
        dst.index_copy_(0, entries, buf.index_select(0, tail_rows).view(S, -1, buf.shape[-1]).to(dst.dtype))


def write_hidden(snaps: SnapshotStore, entries: torch.Tensor, hidden_rows: torch.Tensor,
                 hidden_TD: torch.Tensor) -> None:
    """Store the final hidden [D] of the token before each boundary (rows [S] of hidden_TD [T, D]) with its snapshot
    entry [S] (speculative decoding: the MTP drafter's h_{p-1} after a prefix hit); as SnapshotStore.write_hidden."""
    snaps.hidden.index_copy_(0, entries, hidden_TD.index_select(0, hidden_rows).to(snaps.hidden.dtype))


def ends_at_step_end(seqs) -> bool:
    """True when every snapshot the step must write sits at the end of its sequence's step (boundary p = start +
    Tn): those are the states left in the pools, which a static step can copy after it ran."""
    return all(p == s.start + len(s.tokens) for s in seqs for p, _ in s.snapshots)


def write_step_end_snapshots(snaps: SnapshotStore, states, seqs, hidden_ND: torch.Tensor, Tn: int) -> None:
    """After a static step of `seqs`, each bringing Tn tokens: write every snapshot of the step (all at the step's
    end, see ends_at_step_end) from the pools the step left: the KDA state and conv tails of the sequence's slot,
    and with speculation the final hidden of its last token (row n * Tn + Tn - 1 of hidden_ND [B * Tn, D], packed).
    Same values as the eager step's write_snapshots, a fixed number of ops per KDA layer."""
    entries, slots, rows = [], [], []
    for n, s in enumerate(seqs):
        for _, entry in s.snapshots:
            entries.append(entry)
            slots.append(s.slot)
            rows.append(n * Tn + Tn - 1)
    if not entries:
        return
    t = to_device({"entry": entries, "slot": slots, "row": rows}, hidden_ND.device)
    for layer, (state, tails) in enumerate(zip(states.state, states.tails, strict=True)):
        snaps.state[layer].index_copy_(0, t["entry"], state.index_select(0, t["slot"]).to(snaps.state[layer].dtype))
        for dst, src in zip(snaps.tails[layer], tails, strict=True):
            dst.index_copy_(0, t["entry"], src.index_select(0, t["slot"]).to(dst.dtype))
    if snaps.hidden is not None:
        write_hidden(snaps, t["entry"], t["row"], hidden_ND)
