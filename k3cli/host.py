"""Process-wide host settings the `k3` command applies before any work: how OpenMP's threads wait, and glibc malloc
keeping freed memory.

OpenMP (torch's intra-op threads on the CPU): a thread that finishes its share of an op waits for the next one. On an
idle machine a short spin before sleeping is fastest: the default `k3 pretrain` step on the 2-core AMD EPYC machine
took 1.24-1.32 s spinning briefly (GOMP_SPINCOUNT=2000) and 1.71 s with OMP_WAIT_POLICY=PASSIVE (a futex wake-up per
parallel op, tens of thousands a step). When other processes share the cores, spinning steals their time and the
step slows: 2.97 s spinning 2,000 times against 2.08 s passive beside one busy process (5.2 s at 10,000 spins,
10-20x slower at libgomp's default). So the wait is chosen at start from what the other processes use in a 0.2 s
sample of /proc/stat: brief spinning when they use under SHARED_BUSY of the machine, passive waiting otherwise (or
off Linux). Either environment variable set by the user wins.

PyTorch's CPU tensors come straight from malloc. glibc serves blocks above its mmap threshold (128 KiB, raised
dynamically to at most 32 MiB) with fresh mmaps and returns freed heap tops to the kernel past its trim threshold,
so a training step that allocates and frees thousands of 1-16 MiB activations page-faults (and zero-fills) every one
of them again: on the 2-core AMD EPYC machine, the default `k3 pretrain` step took 1.54-1.62 s with 1.3M minor faults
per 20 steps, and 1.13-1.44 s with 0.56M once freed memory is kept (benchmarks/RESULTS.md, "The README's first
command"). Keeping it is what PyTorch's CUDA caching allocator does for the GPU; the cost is that the process keeps
its peak heap (the same peak RSS here: 2.39 vs 2.44 GB).

A user who tunes malloc through the environment (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, or malloc tunables
in GLIBC_TUNABLES) keeps their settings: nothing is changed then. K3_MALLOC=system opts out.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from collections.abc import Callable

# mallopt parameter numbers from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 1 << 30  # blocks below 1 GiB come from the heap, so they are reused instead of re-mapped
TRIM_THRESHOLD_BYTES = 1 << 31  # the heap top is returned to the kernel only past 2 GiB of free space

SPIN_COUNT = "2000"  # ~tens of microseconds of spinning, then sleep: bridges the gap between two eager ops
SHARED_BUSY = 0.15  # the other processes' share of all cores above which the machine counts as shared
SAMPLE_S = 0.2


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies over all cores since boot, from /proc/stat's first line; None where it is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def others_busy(sample_s: float = SAMPLE_S) -> float | None:
    """The share of all cores (0..1) busy over the next sample_s seconds while this process sleeps; None off Linux."""
    a = _cpu_jiffies()
    if a is None:
        return None
    time.sleep(sample_s)
    b = _cpu_jiffies()
    if b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


def omp_wait_env(env: dict[str, str], busy: Callable[[], float | None] = others_busy) -> dict[str, str]:
    """The OpenMP wait settings to add to `env` (module docstring): {} when the user set either variable (busy is
    not sampled then), {"GOMP_SPINCOUNT": "2000"} on a machine measured idle (busy() < SHARED_BUSY),
    {"OMP_WAIT_POLICY": "PASSIVE"} otherwise. Example: omp_wait_env({}, lambda: 0.01) -> {"GOMP_SPINCOUNT": "2000"}."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return {}
    b = busy()
    if b is not None and b < SHARED_BUSY:
        return {"GOMP_SPINCOUNT": SPIN_COUNT}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def _user_tuned(env: dict[str, str]) -> bool:
    return ("MALLOC_MMAP_THRESHOLD_" in env or "MALLOC_TRIM_THRESHOLD_" in env
            or "glibc.malloc" in env.get("GLIBC_TUNABLES", "") or env.get("K3_MALLOC", "").lower() == "system")


def retain_freed_memory(env: dict[str, str] | None = None) -> bool:
    """Set glibc's mmap and trim thresholds so freed tensors' memory is reused without new page faults.

    Returns True when the thresholds were set; False off glibc (macOS, musl, Windows), when the environment tunes
    malloc itself (module docstring), or when mallopt refuses a value. Example: retain_freed_memory() -> True on Linux.
    """
    env = os.environ if env is None else env
    if _user_tuned(env) or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # mallopt returns 1 on success, 0 when it refuses the value; setting either disables glibc's dynamic threshold
    ok_mmap = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok_trim = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return ok_mmap and ok_trim
