"""The forward's w/u step fused into the state scan (triton_scan_wu.py, LAUNCH["scan"]["FUSE_WU"], experimental and
off by default): the same outputs, final states, intermediate states and gradients as the two kernels it replaces,
which test_kda_triton.py checks against the float64 recurrence; the w/u kernel is not launched by the forward.

Compared at rounding level: the fused kernel's dots are tiled differently (its own V block and warps).
"""

import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

# after the skip; conftest imported the kernel modules under the interpreter on a CPU
from k3.kernels.kda import chunk_kda, l2norm, naive_recurrent_kda, triton_chunk
from k3.kernels.testing import assert_close

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]

pytestmark = pytest.mark.usefixtures("triton_kda_backward")  # tests/kernels/conftest.py


def inputs(B, T, H, HV, D, dtype, N=None):
    torch.manual_seed(0)
    q, k = l2norm(torch.rand(B, T, H, D)), l2norm(torch.rand(B, T, H, D))
    v = torch.rand(B, T, HV, D)
    g = F.logsigmoid(torch.randn(B, T, HV, D)).clamp_min(-5.0)
    beta = torch.randn(B, T, HV).sigmoid()
    h0 = torch.randn(N or B, HV, D, D)
    return [x.to(DEV, dtype) for x in (q, k, v)] + [g.to(DEV), beta.to(DEV, dtype), h0.to(DEV)]


def same(name, a, b, dtype):
    """Equal at rounding level (relative RMS): the fused kernel runs its own V block (FUSE_WU_BV), so its dots are
    tiled differently even on the CPU."""
    assert_close(name, a.detach().double(), b.detach(), 1e-6 if dtype == torch.float32 else 0.004)


@pytest.fixture
def wu_launches(monkeypatch):
    """Names of the forward's step-3/4 kernels as they launch (the module-level kernels, looked up at call time)."""
    log = []
    for name in ("_wu_kernel", "_scan_kernel", "_scan_wu_kernel"):
        real = getattr(triton_chunk, name)
        monkeypatch.setattr(triton_chunk, name, type("Spy", (), {"__getitem__": lambda _, grid, n=name, r=real: (
            log.append(n), r[grid])[1]})())
    return log


CASES = [  # (B, T, H, HV, D, chunk size, safe gate, cu_seqlens)
    (2, 70, 1, 2, 32, 64, True, None),  # GVA, a partial last chunk
    (1, 50, 1, 1, 100, 32, False, None),  # K = 100: masked columns
    (1, 80, 1, 1, 64, 64, True, [0, 15, 15, 80]),  # varlen with an empty sequence
]
IDS = [f"B{c[0]}-T{c[1]}-HV{c[3]}-D{c[4]}-BT{c[5]}{'-varlen' if c[7] else ''}" for c in CASES]


def run(xs, BT, safe, cu, **kw):
    return chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=BT, safe_gate=safe,
                     lower_bound=-5.0 if safe else None,
                     cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV), **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("B,T,H,HV,D,BT,safe,cu", CASES, ids=IDS)
def test_fused_wu_forward_matches_the_two_kernels(B, T, H, HV, D, BT, safe, cu, dtype, wu_launches, monkeypatch):
    xs = inputs(B, T, H, HV, D, dtype, N=None if cu is None else len(cu) - 1)
    with torch.no_grad():
        o0, s0 = run(xs, BT, safe, cu)
        o0i, s0i, h0i = run(xs, BT, safe, cu, return_intermediate_states=True)
    assert wu_launches == ["_wu_kernel", "_scan_kernel"] * 2
    wu_launches.clear()
    monkeypatch.setitem(triton_chunk.LAUNCH["scan"], "FUSE_WU", True)
    with torch.no_grad():
        o1, s1 = run(xs, BT, safe, cu)  # the output fused into the scan too
        o1i, s1i, h1i = run(xs, BT, safe, cu, return_intermediate_states=True)  # states stored, output kernel
    assert wu_launches == ["_scan_wu_kernel"] * 2
    for name, a, b in (("o", o0, o1), ("ht", s0, s1), ("o (intermediate states)", o0i, o1i),
                       ("ht (intermediate states)", s0i, s1i), ("h", h0i, h1i)):
        same(name, a, b, dtype)


@pytest.mark.parametrize("B,T,H,HV,D,BT,safe,cu", CASES, ids=IDS)
def test_fused_wu_training_forward_keeps_the_same_states(B, T, H, HV, D, BT, safe, cu, wu_launches, monkeypatch):
    """A training forward with the fused step stores w, u and kg for its backward (STORE_WU): the gradients are those
    of the two-kernel forward, and match the float64 recurrence."""
    xs = inputs(B, T, H, HV, D, torch.float32, N=None if cu is None else len(cu) - 1)
    do = torch.randn(xs[2].shape, device=DEV)

    def grads():
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        o, s = run(leaves, BT, safe, cu)
        return [o, s, *torch.autograd.grad((o * do).sum() + s.sum(), leaves)]

    ref = grads()
    monkeypatch.setitem(triton_chunk.LAUNCH["scan"], "FUSE_WU", True)  # a forward keeping states: not this flag
    wu_launches.clear()
    assert grads()[0] is not None and wu_launches == ["_wu_kernel", "_scan_kernel"]
    monkeypatch.setitem(triton_chunk.LAUNCH["scan"], "FUSE_WU_KEEP", True)
    wu_launches.clear()
    out = grads()
    assert wu_launches == ["_scan_wu_kernel"], "the backward recomputes nothing while the forward keeps its states"
    for name, a, b in zip(["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"], ref, out, strict=True):
        same(name, a, b, torch.float32)
    # and the float64 recurrence, for the output (the gradients are the two-kernel path's, checked elsewhere)
    q, k, v, g, beta, h0 = (x.detach().double().cpu() for x in xs)
    bounds = [(0, T)] if cu is None else list(itertools.pairwise(cu))
    want = torch.cat([naive_recurrent_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                          initial_state=h0[n : n + 1] if cu is not None else h0)[0]
                      for n, (a, b) in enumerate(bounds)], 1)
    assert_close("o vs the recurrence", want, out[0], 0.005)
