"""Helpers shared by the chunkwise KDA kernels, forward (chunk_fwd.py) and backward (chunk_bwd.py): the device's
multiprocessor count for the launch heuristics, a launch that falls back to 1 stage where a pipelined one does not
fit, the dot precision of fp32 inputs, a program's chunk or sequence bounds (padded and varlen layouts, both
directions), the tile loads and dots both directions use, and the varlen chunk tables. Legend as in chunk_fwd.py.
"""

from __future__ import annotations

import functools
import itertools
import weakref

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ...dispatch import active_config
from ..checks import SUB_CHUNK

# the 16 x 16 blocks (BC = checks.SUB_CHUNK) in which the intra kernel and the solve write the triangular [BT, BT] tiles
BLOCK: tl.constexpr = tl.constexpr(SUB_CHUNK)
RCP_LN2 = 1.4426950408889634  # 1 / ln 2: every exp becomes exp2 (kda.md 3.2 step 1)


@functools.cache
def sm_count(index: int) -> int:
    """Multiprocessors of CUDA device `index` (the `sms` of the launch heuristics)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sms(dev: torch.device) -> int:
    """sm_count of a CUDA device; 0 elsewhere (the CPU interpreter keeps LAUNCH's V blocks)."""
    return sm_count(dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else 0


# launches whose pipelined kernel did not fit its device's shared memory, relaunched at 1 stage (launch_fitting)
_UNFIT: set[tuple] = set()

def fp32_dot_precision() -> str:
    """The precision of every chunk-kernel dot (forward and backward) for fp32 inputs: KernelConfig.kda_fp32_dots
    (K3_KDA_FP32_DOTS). "tf32x3" (the default: three tf32 MMAs per product, hi * hi + hi * lo + lo * hi, near fp32 on
    the tensor cores), "ieee" (fp32 FMA, no tensor cores) or "tf32" (one MMA, 10-bit mantissas: Triton's own default
    for fp32 dots, which fla-core 0.6.0's kernels take). H200, fp32 at (8, 4096, 16, 128), fwd / fwd+bwd ms: ieee
    91.1 / 241.1; tf32x3 4.58 / 21.2, its output within 4.8e-7 relative RMS of ieee's; tf32 2.56 / 9.26, 1.8e-3
    off."""
    return active_config().kda_fp32_dots


def _launch_key(kernel, args, kw) -> tuple:
    """What decides a compiled kernel's shared memory: the kernel, its constexprs and launch options, its tensors'
    dtypes, the device."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return (kernel.__name__, tuple(sorted(kw.items())), tuple(a.dtype for a in tensors), tensors[0].device)


def launch_fitting(kernel, grid, *args, **kw) -> None:
    """kernel[grid](*args, **kw), at 1 stage instead of kw's num_stages where the pipelined kernel's shared memory
    does not fit the device: Triton raises OutOfResources when it loads the compiled kernel, before anything runs.
    The state scans at 3 stages need up to 216 KB in bf16 at K = 128 (an H200 gives a block 227 KB), but 288 KB in
    fp32 and 376 KB at K = 256 (sm_90a). A refused launch is remembered, so it is tried
    once per signature; the check costs nothing while none was refused."""
    if _UNFIT and _launch_key(kernel, args, kw) in _UNFIT:
        kw = {**kw, "num_stages": 1}
    try:
        kernel[grid](*args, **kw)
    except OutOfResources:
        if kw.get("num_stages", 1) == 1:
            raise
        _UNFIT.add(_launch_key(kernel, args, kw))
        kernel[grid](*args, **{**kw, "num_stages": 1})


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b, accumulated in fp32. PREC: a tl.dot input_precision ('ieee', 'tf32', 'bf16x3'), or 'bf16': both operands
    rounded to bf16 first, one MMA per tile (what fla-core 0.6.0 does in its inter-chunk backward kernels).
    'bf16_emulated' is 'bf16' for Triton 3.6's CPU interpreter, whose tl.dot of bf16 operands returns garbage
    (~1e10 off at 16 x 16) and whose fp32 -> bf16 cast truncates: the fp32 operands rounded to the nearest bf16
    (ties to even, as the GPU's cast), then multiplied in fp32 (what the MMA computes)."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16_emulated":
        return tl.dot(_round_bf16(a.to(tl.float32)), _round_bf16(b.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _round_bf16(x):
    """fp32 x rounded to the nearest bf16 value (ties to even), kept in fp32: add half an ulp of the 16 dropped bits
    (minus one unless the kept lowest bit is 1) and clear them. Finite inputs only."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT: tl.constexpr, VARLEN: tl.constexpr):
    """(first token of chunk i_t, its number of real tokens) for fixed-length or varlen sequences."""
    if VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_t).to(tl.int64)
        i_c = tl.load(chunk_indices + 2 * i_t + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        i_n = i_t // NT
        i_c = i_t % NT
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    start = bos + i_c * BT
    return start, tl.minimum(eos - start, BT).to(tl.int32)


@triton.jit
def _f32(x):
    """A float scalar argument as fp32 (every chunk, gate, L2-norm and decode kernel takes its float scalars through
    this at entry). Triton's launcher passes a Python float as fp32, but inductor, launching a kernel inside
    torch.compile, as fp64 (torch 2.11), and an fp64 scalar makes the tiles it touches fp64 or fails
    the compile ("Both operands must be same dtype")."""
    return tl.full([], x, tl.float32)


def _interpreted_range(start, end):
    """start, start + 1, ... while below end, with end a runtime scalar of an interpreted kernel (loop_range)."""
    i = start
    while i < end:  # a scalar comparison, read with bool(): what a kernel's own `while` does under the interpreter
        yield i
        i += 1


# The iterator of the kernels' counted loops over a runtime bound (a sequence's chunks, a program's sub-chunks).
# Compiled, it is tl.range itself: a counted loop, which the compiler software-pipelines with the launch's num_stages
# (a while loop it never does), and the same code as the builtin range. Under Triton's interpreter (TRITON_INTERPRET=1
# when triton.jit wrapped the kernels, as it wrapped _f32) a Python while over the bound: Triton 3.6's interpreter
# turns a range bound into a Python int with int() of its 1-element array, which numpy >= 2.4 refuses ("only
# 0-dimensional arrays can be converted to Python scalars"; Triton 3.7 squeezes the array first).
INTERPRETED = not isinstance(_f32, triton.runtime.JITFunction)
loop_range = _interpreted_range if INTERPRETED else tl.range


@triton.jit
def _load_lower_blocks(p, o_t, m_t):
    """A chunk's [BT, BT] tile at pointers p (o_t = arange(BT), m_t its valid rows), its 16 x 16 blocks j // 16 <=
    i // 16 as stored and 0 in the blocks above them and in rows past the end: for a tile whose writer zeroes the
    upper part of its diagonal blocks itself and leaves the blocks above unwritten (Aqk, the intra kernel's)."""
    return tl.load(p, mask=m_t[:, None] & ((o_t[None, :] // BLOCK) <= (o_t[:, None] // BLOCK)), other=0.0)


@triton.jit
def _load_tril(p, o_t, m_t, STRICT: tl.constexpr):
    """A chunk's lower-triangular [BT, BT] tile at pointers p (o_t = arange(BT), m_t its valid rows): j <= i (j < i
    with STRICT) as stored, 0 elsewhere and in rows past the end. Loaded with a mask of whole 16 x 16 blocks (the
    blocks j // 16 <= i // 16, which the intra kernel and the solve write), then cut to the triangle in registers:
    an element mask leaves each thread 2- or 4-byte loads (ptxas, sm_90a: 32 ld.global.b16 a thread in the w/u
    kernel), the block mask 16-byte ones. What the upper part of a diagonal block holds (even NaN) is discarded.
    H200: backward inter kernel 1,115 against 1,200 us at (16, 2048, 32, 64) with the element mask, 1,341 against
    1,354 at (8, 4096, 16, 128); the w/u kernel unchanged."""
    b = _load_lower_blocks(p, o_t, m_t)
    return tl.where((o_t[None, :] < o_t[:, None]) if STRICT else (o_t[None, :] <= o_t[:, None]), b, 0.0)


@triton.jit
def _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, NT, BT: tl.constexpr, VARLEN: tl.constexpr):
    """(first token, end token, index of its first chunk among all chunks, number of chunks) of sequence i_n, for the
    state scans that walk one sequence's chunks in order (forward) or in reverse (backward). VARLEN 2: cu_seqlens
    holds (first token, end token) pairs, one per sequence (a time segment of each, segments.py)."""
    if VARLEN == 2:
        bos = tl.load(cu_seqlens + 2 * i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + 2 * i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
        n_chunks = tl.cdiv(eos - bos, BT).to(tl.int32)
    elif VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
        n_chunks = tl.cdiv(eos - bos, BT).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c0 = i_n.to(tl.int64) * NT
        n_chunks = NT
    return bos, eos, c0, n_chunks


_LAYOUT_CACHE: list = []  # [(weakref to cu_seqlens, its _version, chunk_size, device, layout)], the latest few


def chunk_layout(B, T, chunk_size, cu_seqlens, device, cu_host=None):
    """Chunk bookkeeping shared by forward and backward: (N, NT, NT_all, chunk_indices [NT_all, 2] int32,
    chunk_offsets [N + 1] int32, cu_seqlens int32); the index tensors are None without varlen.

    The varlen layout needs the sequence lengths on the host: `cu_host` (the offsets as host ints, from callers that
    have them) or else one read of cu_seqlens, which waits for the GPU queue. The two index tables then go to the
    device in one copy that does not wait. A model calls this with the same cu_seqlens tensor in every layer, forward
    and backward, so the result is reused while that very tensor object is alive and unmodified (identity +
    _version)."""
    if cu_seqlens is None:
        NT = triton.cdiv(T, chunk_size)
        return B, NT, B * NT, None, None, None
    for ref, version, bt, dev, layout in _LAYOUT_CACHE:
        if ref() is cu_seqlens and version == cu_seqlens._version and bt == chunk_size and dev == str(device):
            return layout
    layout = _chunk_layout_varlen(chunk_size, cu_seqlens, device, cu_host)
    _LAYOUT_CACHE.insert(0, (weakref.ref(cu_seqlens), cu_seqlens._version, chunk_size, str(device), layout))
    del _LAYOUT_CACHE[4:]
    return layout


def _chunk_layout_varlen(chunk_size, cu_seqlens, device, cu_host=None):
    lens = [b - a for a, b in itertools.pairwise(cu_host if cu_host is not None else cu_seqlens.tolist())]
    per = [triton.cdiv(n, chunk_size) for n in lens]
    NT_all = sum(per)
    # one int32 host buffer [chunk_indices (2 * NT_all), padding to 16 bytes | chunk_offsets (N + 1)]: a
    # `torch.tensor(list, device="cuda")` is a blocking copy (it waits for the queue), pinned + non_blocking is not
    pad = -2 * NT_all % 4  # chunk_offsets stays 16-byte aligned, like a tensor of its own (Triton pointer hints)
    host = torch.tensor([v for n, m in enumerate(per) for c in range(m) for v in (n, c)] + [0] * pad
                        + [0, *itertools.accumulate(per)], dtype=torch.int32)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    dev_t = host.to(device, non_blocking=True)
    chunk_indices, chunk_offsets = dev_t[:2 * NT_all].view(NT_all, 2), dev_t[2 * NT_all + pad:]
    cu = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    return len(lens), 0, NT_all, chunk_indices, chunk_offsets, cu


def _layout_args(B, T, chunk_size, cu_seqlens, device, cu_host, placeholder):
    """chunk_layout with the varlen index tensors replaced by `placeholder` when there is no varlen (the kernels
    take them as arguments and ignore them under VARLEN=False)."""
    N, NT, NT_all, chunk_indices, chunk_offsets, cu = chunk_layout(B, T, chunk_size, cu_seqlens, device, cu_host)
    if cu_seqlens is None:
        chunk_indices = chunk_offsets = cu = placeholder
    return N, NT, NT_all, chunk_indices, chunk_offsets, cu
