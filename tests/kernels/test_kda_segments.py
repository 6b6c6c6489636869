"""The forward's w/u kernel and state scan in time segments (LAUNCH["scan"]["SEGMENT_CHUNKS"], segments.py:
on a GPU the w/u of segment s + 1 runs on a side stream during the scan of segment s) against one w/u launch and
one scan: the same chunks and the same fp32 state carried across the segment boundaries, so the same outputs,
final states and gradients (bitwise under the CPU interpreter, within fp32 reordering on a GPU). Launch spies
prove the segments ran; buffers come NaN-poisoned from torch.empty (tests/conftest.py), so a chunk no segment
covers fails the comparison.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

# after the skip; conftest imported the kernel modules under the interpreter on a CPU
from k3.kernels.kda import chunk_kda, l2norm
from k3.kernels.kda.triton import chunk_fwd as fwd_mod
from k3.kernels.kda.triton import launch as launch_mod
from k3.kernels.kda.triton.segments import segment_tables

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NEVER = 1 << 30

pytestmark = pytest.mark.usefixtures("triton_kda_backward")  # tests/kernels/conftest.py

CASES = [  # (B, T, H, HV, K, V, chunk_size, h0)
    (2, 200, 1, 2, 32, 32, 32, True),  # 7 chunks a sequence, the last partial
    (1, 130, 2, 4, 60, 40, 16, False),  # GVA, K and V masked, 9 chunks, no initial state
]
MODES = ["inference", "output-kernel", "training"]


def _inputs(B, T, H, HV, K, V):
    torch.manual_seed(0)
    q, k = l2norm(torch.rand(B, T, H, K)), l2norm(torch.rand(B, T, H, K))
    v, g = torch.rand(B, T, HV, V), F.logsigmoid(torch.randn(B, T, HV, K)).clamp_min(-5.0)
    beta, h0 = torch.randn(B, T, HV).sigmoid(), torch.randn(B, HV, K, V)
    return [x.to(DEV) for x in (q, k, v, g, beta, h0)]


def _run(monkeypatch, launch_spy, xs, per, *, BT, h0, mode):
    """(o, final state, gradients or None, scan launches, w/u launches) with LAUNCH["scan"]["SEGMENT_CHUNKS"] =
    per (0: one scan)."""
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "SEGMENT_CHUNKS", per)
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "OUTPUT_FROM", NEVER if mode == "output-kernel" else 0)
    scans, wus = launch_spy(fwd_mod, "_scan_kernel"), launch_spy(fwd_mod, "_wu_kernel")
    grad = mode == "training"
    leaves = [x.detach().clone().requires_grad_(grad) for x in xs]
    o, s = chunk_kda(*leaves[:5], initial_state=leaves[5] if h0 else None, output_final_state=True, chunk_size=BT,
                     safe_gate=True, lower_bound=-5.0)
    grads = None
    if grad:
        torch.manual_seed(1)
        do, ds = torch.randn_like(o), torch.randn_like(s)
        grads = torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves if h0 else leaves[:5])
    return o.detach(), s.detach(), grads, len(scans), len(wus)


@pytest.fixture(scope="module")
def one_scan():
    """one_scan(monkeypatch, launch_spy, B, T, H, HV, K, V, BT, h0, mode): _run of _inputs(B, T, H, HV, K, V) with one
    scan (SEGMENT_CHUNKS 0), run once a module for each case and mode: the reference of every segment count and
    priority setting (deterministic: the same inputs and launches give the same outputs each time)."""
    refs = {}

    def get(monkeypatch, launch_spy, B, T, H, HV, K, V, BT, h0, mode):
        key = (B, T, H, HV, K, V, BT, h0, mode)
        if key not in refs:
            refs[key] = _run(monkeypatch, launch_spy, _inputs(B, T, H, HV, K, V), 0, BT=BT, h0=h0, mode=mode)
        return refs[key]

    return get


def _same(name, a, b):
    assert torch.isfinite(b).all(), f"{name}: not finite (a chunk no segment covered?)"
    if DEV == "cpu":
        assert torch.equal(a, b), f"{name} differs with the scan in segments"
    else:
        err = ((a - b).norm() / a.norm().clamp_min(1e-12)).item()
        assert err < 1e-6, f"{name}: relative change {err:.2e} with the scan in segments"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per", [1, 2, 3])
@pytest.mark.parametrize("B,T,H,HV,K,V,BT,h0", CASES, ids=["partial-chunk", "gva-masked"])
def test_segments_match_one_scan(B, T, H, HV, K, V, BT, h0, per, mode, monkeypatch, launch_spy, one_scan):
    """per chunks a segment: 7 / 3 / 2 segments of the 7 chunks of the first case, 9 / 4 / 3 of the 9 of the
    second."""
    segments = -(-T // BT) // per
    ref = one_scan(monkeypatch, launch_spy, B, T, H, HV, K, V, BT, h0, mode)
    out = _run(monkeypatch, launch_spy, _inputs(B, T, H, HV, K, V), per, BT=BT, h0=h0, mode=mode)
    assert ref[3:] == (1, 1) and out[3:] == (segments, segments), "segment launches"
    _same("o", ref[0], out[0])
    _same("final state", ref[1], out[1])
    for i, (a, b) in enumerate(zip(ref[2] or (), out[2] or (), strict=True)):
        _same(f"gradient {i}", a, b)


@pytest.mark.parametrize("priority", [True, False])
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_segments_with_and_without_a_high_priority_stream(mode, priority, monkeypatch, launch_spy, one_scan):
    """LAUNCH["scan"]["SEGMENT_PRIORITY"] (on as shipped): the segments' scans on a high-priority side stream, or on
    the current stream (a GPU's scheduling only; the interpreter runs the same order): the same results as one scan."""
    ref = one_scan(monkeypatch, launch_spy, *CASES[0], mode)
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "SEGMENT_PRIORITY", priority)
    out = _run(monkeypatch, launch_spy, _inputs(*CASES[0][:6]), 2, BT=32, h0=True, mode=mode)
    assert out[3:] == (3, 3), "segment launches"
    _same("o", ref[0], out[0])
    _same("final state", ref[1], out[1])
    for i, (a, b) in enumerate(zip(ref[2] or (), out[2] or (), strict=True)):
        _same(f"gradient {i}", a, b)


def test_segments_fall_back_to_one_scan(monkeypatch, launch_spy):
    """Varlen inputs, and sequences with fewer than two segments' chunks, run one w/u launch and one scan."""
    xs = _inputs(1, 40, 1, 2, 32, 32)
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "SEGMENT_CHUNKS", 2)
    scans = launch_spy(fwd_mod, "_scan_kernel")
    chunk_kda(*xs[:5], initial_state=xs[5][:1], chunk_size=32)  # 2 chunks: one segment of 2
    chunk_kda(*xs[:5], initial_state=torch.cat([xs[5][:1]] * 2), chunk_size=16,
              cu_seqlens=torch.tensor([0, 15, 40], device=DEV))
    assert len(scans) == 2
    chunk_kda(*xs[:5], initial_state=xs[5][:1], chunk_size=16)  # 3 chunks: 3 // 2 = 1 segment, still one scan
    assert len(scans) == 3


def test_segment_tables():
    """Segment s of every sequence covers chunks [s NT / P, (s + 1) NT / P): B = 2, T = 100, BT = 32 (NT = 4, the
    last chunk 4 tokens), P = 3."""
    cu, segs = segment_tables(2, 100, 32, 3, torch.device("cpu"))
    assert cu.tolist() == [0, 100, 200]
    chunks, bounds, offsets, n = ([s[i] for s in segs] for i in range(4))
    assert [c.tolist() for c in chunks] == [[[0, 0], [1, 0]], [[0, 1], [1, 1]], [[0, 2], [0, 3], [1, 2], [1, 3]]]
    assert [b.tolist() for b in bounds] == [[[0, 32], [100, 132]], [[32, 64], [132, 164]], [[64, 100], [164, 200]]]
    assert [o.tolist() for o in offsets] == [[0, 4], [1, 5], [2, 6]]
    assert n == [2, 2, 4]


def test_scan_segments_rule(monkeypatch):
    """NT // SEGMENT_CHUNKS segments (at least 2) when the scan runs fewer programs than SEGMENT_BELOW x the
    multiprocessors of the device (132 here, as an H200's), padded layout only; 0 off with SEGMENT_CHUNKS 0."""
    monkeypatch.setattr(launch_mod, "device_sms", lambda dev: 132)
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "SEGMENT_CHUNKS", 128)
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "SEGMENT_BELOW", 1)
    dev = torch.device("cpu")
    assert launch_mod.scan_segments(256, 128, None, dev) == 2  # (2, 16384, 16, 128): 128 programs at V block 32
    assert launch_mod.scan_segments(1024, 64, None, dev) == 8  # (1, 65536, 16, 128)
    assert launch_mod.scan_segments(1024, 64, torch.tensor([0, 65536]), dev) == 0  # varlen
    assert launch_mod.scan_segments(64, 256, None, dev) == 0  # (8, 4096, 16, 128): too few chunks
    assert launch_mod.scan_segments(300, 132, None, dev) == 0  # as many programs as multiprocessors
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "SEGMENT_BELOW", 2)
    assert launch_mod.scan_segments(300, 132, None, dev) == 2
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "SEGMENT_CHUNKS", 0)
    assert launch_mod.scan_segments(1024, 64, None, dev) == 0
