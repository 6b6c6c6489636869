"""Paged absorbed MLA decode (k3kernels/mla): the Triton kernel (interpreter on a CPU, the GPU in fp32 and bf16) and
its PyTorch twin against an independent float64 reference that walks each sequence's keys one position at a time."""

import importlib.util
import math

import pytest
import torch

from k3.kernels.mla import paged_mla_decode_torch

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
HAS_TRITON = importlib.util.find_spec("triton") is not None


pytestmark = pytest.mark.usefixtures("triton_cpu")  # tests/kernels/conftest.py


def reference(q_lat, q_rope, pool, bt, qpos, scale, min_key):
    """float64, one query at a time: key j of sequence n read from pool[bt[n, j // PS], j % PS]."""
    N, T, H, C = q_lat.shape
    PS = pool.shape[1]
    out = torch.zeros(N, T, H, C, dtype=torch.float64)
    pool = pool.double().cpu()
    for n in range(N):
        for t in range(T):
            keys = [pool[bt[n, j // PS], j % PS] for j in range(min_key, int(qpos[n, t]) + 1)]
            kv = torch.stack(keys)  # [S, C + R]
            for h in range(H):
                s = kv[:, :C] @ q_lat[n, t, h].double().cpu() + kv[:, C:] @ q_rope[n, t, h].double().cpu()
                p = torch.softmax(s * scale, dim=0)
                out[n, t, h] = p @ kv[:, :C]
    return out


def make(N, T, H, C, R, PS, lens, dtype, seed=0):
    """Pool of shuffled pages; sequence n holds lens[n] keys, its T queries at the last T positions."""
    gen = torch.Generator().manual_seed(seed)
    G = max(math.ceil(L / PS) for L in lens)
    P = N * G + 3
    pool = torch.randn(P, PS, C + R, generator=gen)
    perm = torch.randperm(P, generator=gen)[: N * G].view(N, G)
    q_lat = torch.randn(N, T, H, C, generator=gen)
    q_rope = torch.randn(N, T, H, R, generator=gen)
    qpos = torch.tensor([[L - T + t for t in range(T)] for L in lens])
    return q_lat.to(DEV, dtype), q_rope.to(DEV, dtype), pool.to(DEV, dtype), perm.to(DEV, torch.int32), qpos.to(DEV)


CASES = [  # N, T, H, C, R, PS, lens, min_key
    (3, 1, 6, 32, 16, 64, [1, 70, 130], 0),  # decode; a sequence of one key; page crossings
    (2, 3, 2, 32, 16, 128, [5, 200], 0),  # verification window of 3 queries; two 64-key blocks per page
    (2, 1, 4, 48, 0, 64, [64, 65], 0),  # pure NoPE (R = 0), C not a power of two
    (2, 2, 3, 32, 16, 64, [3, 66], 1),  # the MTP layer's mask of slot 0
]


@pytest.mark.parametrize("case", CASES)
def test_twin_matches_reference(case):
    N, T, H, C, R, PS, lens, mk = case
    q, qr, pool, bt, pos = make(N, T, H, C, R, PS, lens, torch.float64 if not CUDA else torch.float32)
    scale = 1 / math.sqrt(C)
    ref = reference(q, qr, pool, bt.cpu(), pos.cpu(), scale, mk)
    out = paged_mla_decode_torch(q, qr, pool, bt, pos, scale=scale, min_key=mk)
    assert out.shape == (N, T, H, C)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="needs the `triton` package")
@pytest.mark.parametrize("split", [0, 64], ids=["one-pass", "split64"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference(case, dtype, split, monkeypatch):
    """split64: every sequence's keys in ranges of 64 over a (N, S) grid, partial results combined (flash-decoding);
    ranges past a sequence's keys and rows with no key at all (the MTP's min_key) must weigh nothing."""
    from k3.kernels.mla import triton_decode
    from k3.kernels.mla.triton_decode import paged_mla_decode_triton

    monkeypatch.setitem(triton_decode.LAUNCH, "split_keys", split)
    monkeypatch.setitem(triton_decode.LAUNCH, "split_below", 1 << 20)
    N, T, H, C, R, PS, lens, mk = case
    q, qr, pool, bt, pos = make(N, T, H, C, R, PS, lens, dtype)
    scale = 1 / math.sqrt(C)
    ref = reference(q, qr, pool, bt.cpu(), pos.cpu(), scale, mk)
    out = paged_mla_decode_triton(q, qr, pool, bt, pos, scale=scale, min_key=mk)
    assert out.dtype == dtype and out.shape == (N, T, H, C)
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert not torch.isnan(out).any()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"rel error {err:.2e}"


def test_bad_shapes_are_clear_errors():
    q, qr, pool, bt, pos = make(2, 1, 2, 32, 16, 64, [3, 4], torch.float32)
    with pytest.raises(ValueError, match=r"kv_pool must be \[P, page, C \+ R = 48\]"):
        paged_mla_decode_torch(q, qr, pool[..., :40], bt, pos, scale=1.0)
    with pytest.raises(ValueError, match="qpos must be an integer"):
        paged_mla_decode_torch(q, qr, pool, bt, pos.float(), scale=1.0)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA or not HAS_TRITON, reason="needs a CUDA GPU and triton (compiled kernels)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_warm_up_compiles_every_query_length(dtype):
    """After warm_up, calls with any query count T (a prefill tail after a prefix hit brings 2..64 tokens) compile
    nothing new: T is a runtime value, BM (16 / 32 / 64 query rows) the only variant, and warm_up compiled each. A
    compile while serving stalled the request 1-5 s on an H200. Counted in Triton's per-device kernel cache."""
    from k3.kernels.mla import triton_decode

    H, C, R, PS = 6, 32, 16, 64
    _, _, pool, _, _ = make(1, 1, H, C, R, PS, [70], dtype)
    triton_decode.warm_up(pool, H, C, R, dtype)
    cache = triton_decode._paged_mla_kernel.device_caches[torch.cuda.current_device()][0]
    n = len(cache)
    for T in range(1, 64 // H + 1):
        q, qr, pool_T, bt, pos = make(2, T, H, C, R, PS, [70, 2 * T + 5], dtype, seed=T)
        triton_decode.paged_mla_decode_triton(q, qr, pool_T, bt, pos, scale=0.1, min_key=T % 2)
    assert len(cache) == n, f"{len(cache) - n} kernel(s) compiled after warm_up"


_COMPILE_INLINED = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3.kernels.mla.triton_decode import _paged_mla_kernel as fn
consts = {"min_key": 0, "G": 4, "KPS": 128, "T": 1, "H": 4, "C": 64, "R": 16, "PS": 64, "BM": 16, "BC": 64, "BR": 16,
          "BS": 64, "PREC": "tf32", "SPLIT": sys.argv[1] == "split"}
sig = {"q_lat": "*bf16", "q_rope": "*bf16", "kv": "*bf16", "bt": "*i32", "qpos": "*i32", "o": "*bf16",
       "ws_m": "*fp32", "ws_l": "*fp32", "ws_acc": "*fp32", "scale": "fp32"}
sig.update({k: "constexpr" for k in consts})
src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
assert ".entry _paged_mla_kernel" in compiled.asm["ptx"]
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("split", ["single", "split"])
def test_kernel_compiles_with_integer_arguments_inlined(split):
    """torch.compile of the serving decode step launches the kernel through inductor, which passes T, min_key, G and
    KPS as Python ints baked into the kernel (constants), not as runtime scalars: the kernel must compile either way.
    Compiled for sm_90 without a GPU (Triton's front end, then ptxas), in a process of its own without the
    interpreter; a `.to` on one of them breaks the compiled server on the H200."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE_INLINED, split], check=False, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
