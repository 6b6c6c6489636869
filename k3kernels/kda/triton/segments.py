"""The forward's w/u kernel and state scan in time segments, the w/u of segment s + 1 running on a side stream
while the scan walks segment s (chunk_fwd.chunk_fwd_states, LAUNCH["scan"]["SEGMENT_CHUNKS"]; also the
backward's recompute with KernelConfig.kda_recompute).

Why: with few scan programs (sequences x value heads x V blocks below the multiprocessor count, e.g. 128 at
(2, 16384, 16, 128) on a 132-multiprocessor H200) the scan's sequential walk over the chunks is the forward's
critical path and leaves most of the GPU idle; the w/u kernel, which every scan step depends on, then runs
before it, alone. Split into P segments of the sequences' chunks, only the first segment's w/u precedes the scan.

A segment s covers chunks [s NT / P, (s + 1) NT / P) of every sequence (padded layout: N = B sequences of T
tokens, NT chunks each). The w/u kernel takes the segment's chunks as a varlen chunk list over the padded
sequences; the scan takes each sequence's token range of the segment (its VARLEN 2: bounds as (begin, end) pairs)
and starts from the state the previous segment's scan stored (its final-state output), so the segments compute
exactly what one scan does: the state is carried in fp32 either way.
"""

from __future__ import annotations

import torch

_TABLES: dict[tuple, tuple] = {}
_SIDE: dict[tuple[torch.device, int], torch.cuda.Stream] = {}


def segment_tables(B: int, T: int, BT: int, P: int, device: torch.device) -> tuple[torch.Tensor, list[tuple]]:
    """(cu_seqlens [B + 1] int32 of the padded sequences, for the w/u kernel's chunk lists; per segment: (chunk list
    [n, 2] int32 of (sequence, chunk) for the w/u kernel, scan bounds [B, 2] int32 of (first token, end token),
    chunk offsets [B] int32 (each sequence's first chunk of the segment among all chunks), n = number of chunks)).
    Built on the host and copied once per (B, T, BT, P, device), at the first call (blocking copies), then kept."""
    key = (B, T, BT, P, str(device))
    if key not in _TABLES:
        NT = -(-T // BT)
        segs = []
        for s in range(P):
            a, b = s * NT // P, (s + 1) * NT // P
            chunks = torch.tensor([[n, c] for n in range(B) for c in range(a, b)], dtype=torch.int32).view(-1, 2)
            bounds = torch.tensor([[n * T + a * BT, min(n * T + b * BT, (n + 1) * T)] for n in range(B)],
                                  dtype=torch.int32)
            offsets = torch.tensor([n * NT + a for n in range(B)], dtype=torch.int32)
            segs.append((chunks.to(device), bounds.to(device), offsets.to(device), chunks.shape[0]))
        _TABLES[key] = (torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device), segs)
    return _TABLES[key]


def _side_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    """A side stream of `device` kept for reuse, one per priority (lower numbers run first: -1 is high, 0 the
    default of every stream)."""
    key = (device, priority)
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device=device, priority=priority)
    return _SIDE[key]


def run_segments(P: int, device: torch.device, launch_wu, launch_scan, priority: bool = False) -> None:
    """launch_wu(s) for s < P on a side stream, launch_scan(s) on the current stream once segment s's w/u is done:
    scan s overlaps w/u s + 1. Off CUDA (the interpreter) one after the other. The side stream starts after
    everything queued before (the solve that wrote M); the current stream's last scan waits for the side's last
    w/u, so later work on it (and the caching allocator's reuse of these tensors) is ordered after both.
    priority: the scans on a high-priority side stream instead (the current one waits for it at the end). Scan s
    and w/u s + 1 become ready together, when w/u s ends; if the w/u programs take the multiprocessors first (two a
    multiprocessor by registers), the scan's, each needing most of one, wait until they drain, and the overlap is
    lost. The block scheduler dispatches a high-priority stream's pending programs first."""
    if device.type != "cuda":
        for s in range(P):
            launch_wu(s)
            launch_scan(s)
        return
    main, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_stream(main)
    done = []
    with torch.cuda.stream(side):
        for s in range(P):
            launch_wu(s)
            done.append(torch.cuda.Event())
            done[-1].record(side)
    scans = _side_stream(device, -1) if priority else main
    if priority:
        scans.wait_stream(main)
    with torch.cuda.stream(scans):
        for s in range(P):
            scans.wait_event(done[s])
            launch_scan(s)
    if priority:
        main.wait_stream(scans)
