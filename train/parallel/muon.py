"""Muon's update for matrices FSDP2 shards along dim 0: whole blocks orthogonalized where they live, the rest
gathered on one owning rank, orthogonalized there and scattered back (docs/parallel.md, "Muon under FSDP2").

Newton-Schulz needs each [a, b] block whole (k3.train.optim). A rank's shard is rows [r c, (r + 1) c) of dim 0,
c = ceil(rows / world) (torch.chunk). Two cases:
- local: every block lies inside one shard, so each rank runs NS5 on its own blocks with no communication: expert
  stacks [E, A, B] (a block is one expert's [A, B], sharded over E) and per-head row blocks when c is a multiple of
  the head's rows.
- gathered: any other matrix. Owners are assigned largest first to the least-loaded rank (ties: lower rank), from
  shapes alone, so every rank agrees without talking. One all_to_all sends each rank's rows of D = G + mu M (in
  NS5's working dtype: bf16 on CUDA, fp32 on the CPU) to the owners, each owner runs NS5 on its whole matrices in
  the single-process batched call, and a second all_to_all returns each rank its rows of the result, which it adds
  with -lr x scale as the one-process step does. Bytes per step: each gathered matrix of n elements moves
  n (world - 1) / world elements there and the same back, in the working dtype.

The momentum, the decay and the update act on each rank's rows elementwise, so the step equals the one-process step
up to the float summation order inside the gradients' reduce-scatter (tested with 2 processes).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from ..optim import MOONLIGHT_SCALE, _apply_muon_updates, _block_view, ns_work_dtype, orthogonalized_blocks
from .runtime import Distributed


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of dim 0 held by `rank` under torch.chunk sharding. Example: shard_rows(5, 2, 1) == (3, 5)."""
    c = -(-rows // world)
    return min(rows, rank * c), min(rows, (rank + 1) * c)


def block_shape(shape: torch.Size, num_heads: int | None, head_axis: int) -> tuple[int, int]:
    """(a, b) of the blocks Muon orthogonalizes in a parameter of `shape` (k3.train.optim._block_view)."""
    a, b = shape[-2], shape[-1]
    if num_heads is None:
        return a, b
    return (a // num_heads, b) if head_axis == 0 else (a, b // num_heads)


def local_blocks(shape: torch.Size, num_heads: int | None, head_axis: int, world: int) -> bool:
    """True when every Muon block of a dim-0-sharded parameter lies inside one rank's rows."""
    if len(shape) == 3:
        return True  # [E, A, B]: dim 0 counts experts; a block never spans two
    if num_heads is None or head_axis == 1:
        return world == 1
    return -(-shape[0] // world) % (shape[0] // num_heads) == 0


def assign_owners(numels: list[int], world: int) -> list[int]:
    """Owning rank of each gathered matrix: largest first to the least-loaded rank, ties to the lower rank.
    Example: assign_owners([4, 4, 8], 2) == [1, 1, 0]"""
    load, owner = [0] * world, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + numels[i]
    return owner


def gathered_bytes(shapes: list[tuple[torch.Size, int | None, int]], world: int, dtype_bytes: int) -> dict:
    """Muon's communication per optimizer step over the data-parallel group, counted from the parameters' shapes.

    shapes: (shape, num_heads, head_axis) of every Muon parameter. Returns {"gathered_matrices", "local_matrices",
    "gathered_elements" (sum of their numels), "bytes_per_step" (sent by all ranks together: gather + scatter),
    "bytes_per_rank" (the most any rank sends)}. Example: gathered_bytes([(torch.Size([64, 32]), None, 0)], 2, 4)
    """
    gathered = [(s, h, a) for s, h, a in shapes if not local_blocks(s, h, a, world)]
    numels = [math.prod(s) for s, _, _ in gathered]
    owners = assign_owners(numels, world)
    sent = [0] * world  # elements each rank sends in both all_to_alls
    for (s, _, _), n, o in zip(gathered, numels, owners, strict=True):
        row = n // s[0]
        for r in range(world):
            if r != o:
                lo, hi = shard_rows(s[0], world, r)
                sent[r] += (hi - lo) * row  # its rows of D to the owner
                sent[o] += (hi - lo) * row  # the owner's NS5 rows back to it
    return {"gathered_matrices": len(gathered), "local_matrices": len(shapes) - len(gathered),
            "gathered_elements": sum(numels), "bytes_per_step": sum(sent) * dtype_bytes,
            "bytes_per_rank": max(sent, default=0) * dtype_bytes}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if type(t).__name__ == "DTensor" else t


class ShardedMuonUpdate:
    """Muon(sharded_update=ShardedMuonUpdate(d)): the update of `todo` (k3.train.optim.Muon.step) for DTensor
    parameters sharded along dim 0 over the data-parallel mesh of `d` (module docstring)."""

    def __init__(self, d: Distributed):
        self.d = d

    def _check(self, p: torch.Tensor) -> None:
        from torch.distributed.tensor import Shard

        w, r = self.d.world_size, self.d.rank
        if type(p).__name__ != "DTensor" or tuple(p.placements) != (Shard(0),) or p.device_mesh.size() != w:
            raise ValueError(f"ShardedMuonUpdate takes parameters sharded along dim 0 over the {w} data-parallel "
                             f"ranks (FSDP2's Shard(0)); got {type(p).__name__} {tuple(p.shape)} "
                             f"{getattr(p, 'placements', None)}")
        lo, hi = shard_rows(p.shape[0], w, r)
        if p.to_local().shape[0] != hi - lo:
            raise ValueError(f"rank {r} holds {p.to_local().shape[0]} rows of a {tuple(p.shape)} parameter, not the "
                             f"{hi - lo} of torch.chunk sharding; FSDP2 changed its layout")

    @torch.no_grad()
    def __call__(self, todo: list) -> None:
        w, me = self.d.world_size, self.d.rank
        local, gathered = [], []
        for p, rule, d in todo:
            self._check(p)
            if not local_blocks(p.shape, rule["num_heads"], rule["head_axis"], w):
                gathered.append((p, rule, d))  # every rank takes part, an empty shard too
                continue
            pl, heads = p.to_local(), rule["num_heads"]
            if pl.numel() == 0:
                continue
            if heads is not None and p.ndim == 2:  # this shard's whole head blocks
                heads = pl.shape[0] // (p.shape[0] // heads)
            local.append((pl, {**rule, "num_heads": heads}, tuple(map(_local, d)) if isinstance(d, tuple) else _local(d)))
        _apply_muon_updates(local)
        by_dtype: dict[torch.dtype, list] = defaultdict(list)
        for item in gathered:
            src = item[2][1] if isinstance(item[2], tuple) else item[2]
            by_dtype[ns_work_dtype(src.device, src.dtype)].append(item)
        for work, items in by_dtype.items():
            self._gather_orthogonalize_scatter(items, work, w, me)

    def _gather_orthogonalize_scatter(self, items: list, work: torch.dtype, w: int, me: int) -> None:
        owners = assign_owners([p.numel() for p, _, _ in items], w)
        row = [p.numel() // p.shape[0] for p, _, _ in items]  # elements per dim-0 row
        rows = [[hi - lo for lo, hi in (shard_rows(p.shape[0], w, r) for r in range(w))] for p, _, _ in items]
        device = items[0][0].device
        # rank me's rows of D for owner o: items owned by o in order
        send = torch.empty(sum(rows[i][me] * row[i] for i in range(len(items))), dtype=work, device=device)
        in_splits = [sum(rows[i][me] * row[i] for i in range(len(items)) if owners[i] == o) for o in range(w)]
        off, pieces = 0, {}
        for o in range(w):
            for i, (p, rule, d) in enumerate(items):
                if owners[i] != o:
                    continue
                n = rows[i][me] * row[i]
                dst = send[off:off + n].view(p.to_local().shape)
                if isinstance(d, tuple):  # G^ = G + mu M at the parameter's precision, rounded once into dst
                    torch.add(_local(d[0]), _local(d[1]), alpha=rule["momentum"], out=dst)
                else:
                    dst.copy_(_local(d))
                pieces[i] = (off, n)
                off += n
        mine = [i for i in range(len(items)) if owners[i] == me]
        out_splits = [sum(rows[i][s] * row[i] for i in mine) for s in range(w)]
        recv = torch.empty(sum(out_splits), dtype=work, device=device)
        self.d.all_to_all(recv, send, out_splits, in_splits)
        # whole matrices of the items this rank owns: sender s's block holds its rows of each, in item order
        full = {i: torch.empty(items[i][0].shape, dtype=work, device=device) for i in mine}
        off = 0
        for s in range(w):
            for i in mine:
                lo, hi = shard_rows(items[i][0].shape[0], w, s)
                n = (hi - lo) * row[i]
                full[i][lo:hi].view(-1).copy_(recv[off:off + n])
                off += n
        ortho = {i: torch.empty_like(full[i]) for i in mine}
        own = [(full[i], items[i][1], full[i]) for i in mine]
        for j, o, _ in orthogonalized_blocks(own):
            i = mine[j]
            _block_view(ortho[i], items[i][1]["num_heads"], items[i][1]["head_axis"]).copy_(o)
        del full
        # back: each rank s its rows of every result this rank owns (item order), the reverse of the splits above
        back = torch.empty(sum(out_splits), dtype=work, device=device)
        off = 0
        for s in range(w):
            for i in mine:
                lo, hi = shard_rows(items[i][0].shape[0], w, s)
                n = (hi - lo) * row[i]
                back[off:off + n].copy_(ortho[i][lo:hi].reshape(-1))
                off += n
        del ortho
        self.d.all_to_all(send, back, in_splits, out_splits)  # send now receives this rank's rows, same layout
        for i, (p, rule, _) in enumerate(items):
            off, n = pieces[i]
            pl = p.to_local()
            scale = MOONLIGHT_SCALE * math.sqrt(max(block_shape(p.shape, rule["num_heads"], rule["head_axis"])))
            pl.add_(send[off:off + n].view(pl.shape), alpha=-rule["lr"] * scale)


def muon_shapes(model: torch.nn.Module, ocfg) -> list[tuple[torch.Size, int | None, int]]:
    """(shape, num_heads, head_axis) of every parameter Muon updates in `model` under optim config `ocfg`, the
    input of `gathered_bytes`. Example: gathered_bytes(muon_shapes(model, OptimConfig()), 8, 2)"""
    from ..optim import param_groups_for

    return [(p.shape, g["num_heads"], g["head_axis"]) for g in param_groups_for(model, ocfg).values()
            if g["optimizer"] == "muon" for p in g["params"]]
