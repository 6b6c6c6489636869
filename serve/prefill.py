"""Host-side bookkeeping of an eager engine step whose cost must not grow with the prompt: the step's index lists in
one host -> device copy, and the KDA prefix-cache snapshots (kda.md section 8, serving.md 2.2) of every block
boundary written with a fixed number of tensor ops per layer.

Why: an eager step on a GPU is host-bound (each tensor op costs ~10-15 us of Python and launch time, the arithmetic
of a k3-small prefill is a few ms). A prefill of T tokens crosses T / 64 block boundaries and the engine snapshots the
KDA state and the three conv tails at each of them. Written one boundary at a time (a slice, a concatenation of the
whole sequence's conv inputs and four copies per tail and state), that was ~30 ops per boundary per KDA layer: a
2048-token k3-small prefill issued ~11,000 tensor ops for its snapshots, about 3x the rest of the step (counted on a
CPU with a TorchFunctionMode, 2026-11-29). Here the rows to copy are listed on the host once per step
(`snapshot_table`, part of the step's single index copy) and each KDA layer gathers and scatters them in ~15 ops
(`write_snapshots`), however many boundaries the step crosses.

Legend: N sequences, T packed tokens, S snapshots written this step, W1 = conv width - 1, C conv channels,
NC chunks of the KDA chunk kernel call, H heads, K = V head dim, D width.
"""

from __future__ import annotations

import torch

from .cache import SnapshotStore


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


def snapshot_table(seqs, cu: list[int], W1: int, chunk_size: int) -> dict[str, list[int]]:
    """The host lists of the step's snapshots (`StepSeq.snapshots`: boundary p, reserved entry), in sequence order:

    snap_entry [S]: snapshot store entries (distinct: each was reserved for its own block hash this step);
    snap_hidden [S]: packed row of the token before the boundary (the MTP drafter's hidden, speculation only);
    snap_tail [S * W1]: rows of cat([pre-conv inputs [T, C], initial tails [N * W1, C]]) holding the last W1 conv
      inputs at the boundary: row r of sequence n's history [tail0[n] ; its Tn inputs] is T + n * W1 + r for
      r < W1, else cu[n] + r - W1;
    snap_slot [S]: the KDA pool slot whose state after the step is the boundary state (boundary = end of the step);
    snap_chunk [S]: row of cat([chunk states [NC, ...], final states [Ng, ...]]) for a chunk kernel call over the
      sequences without a verify step (group g, in order): the state entering chunk j / chunk_size for an interior
      boundary (a chunk boundary, since prefill chunks start block-aligned), the group's final state at the end.
    Empty lists when no sequence writes a snapshot."""
    T = cu[-1]
    group = [n for n, s in enumerate(seqs) if not s.spec]
    total_chunks = sum(-(-len(seqs[n].tokens) // chunk_size) for n in group)
    out = {"snap_entry": [], "snap_hidden": [], "snap_tail": [], "snap_slot": [], "snap_chunk": []}
    chunk_off = 0
    for g, n in enumerate(group):
        s = seqs[n]
        Tn = len(s.tokens)
        for p, entry in s.snapshots:
            j = p - s.start  # tokens of this step consumed at the boundary, 1..Tn
            out["snap_entry"].append(entry)
            out["snap_hidden"].append(cu[n] + j - 1)
            out["snap_tail"] += [T + n * W1 + r if r < W1 else cu[n] + r - W1 for r in range(j, j + W1)]
            out["snap_slot"].append(s.slot)
            out["snap_chunk"].append(total_chunks + g if j == Tn else chunk_off + j // chunk_size)
        chunk_off += -(-Tn // chunk_size)
    if len(set(out["snap_entry"])) != len(out["snap_entry"]):  # index_copy_ needs distinct rows to be deterministic
        raise RuntimeError(f"step: two snapshots share a store entry: {out['snap_entry']}")
    return out


def write_snapshots(snaps: SnapshotStore, layer: int, entries: torch.Tensor, state_src: torch.Tensor,
                    state_rows: torch.Tensor, tail_rows: torch.Tensor, pre) -> None:
    """Write one KDA layer's snapshots of the step into their reserved entries, as fp32: entries [S];
    state_src [R, H, K, V] and state_rows [S] (the boundary states, snapshot_table's snap_slot rows of the pool or
    snap_chunk rows of the chunk call's states); tail_rows [S * W1] (snap_tail); pre: per conv (q, k, v) the
    initial tails [N, W1, C] and the pre-conv inputs [T, C] of all packed tokens.
    Same values as writing each snapshot with SnapshotStore.write."""
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
    Tn): those are the states left in the pools, which a graph step can copy after its replay."""
    return all(p == s.start + len(s.tokens) for s in seqs for p, _ in s.snapshots)


def write_step_end_snapshots(snaps: SnapshotStore, states, seqs, hidden_ND: torch.Tensor, Tn: int) -> None:
    """After a static (graph) step of `seqs`, each bringing Tn tokens: write every snapshot of the step (all at the
    step's end, see ends_at_step_end) from the pools the step left: the KDA state and conv tails of the sequence's
    slot (its conv tail row is its slot, as the graph steps use), and with speculation the final hidden of its last
    token (row n * Tn + Tn - 1 of hidden_ND [B * Tn, D], packed). Same values as the eager step's write_snapshots;
    a fixed number of ops per KDA layer (a boundary crossed during decode used to send the whole step eager)."""
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
