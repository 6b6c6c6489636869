"""The state scans in two levels (triton_chunk.LAUNCH["scan"]["SEGMENT"], triton_scan2.py: segment maps, their
composition, then the scan from each segment's entering state; the backward's reverse scan likewise) against the
one-level scans and the float64 recurrence: outputs, final states, the states entering every chunk and all gradients
(the backward's recompute runs the two-level forward scan too). The two-level path needs fewer scan programs than multiprocessors: the tests report 1,000
multiprocessors. Outputs come from torch.empty, NaN-poisoned by tests/conftest.py. CPU: Triton's interpreter.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

# after the skip; conftest imported the kernel modules under the interpreter on a CPU
from k3.kernels.kda import chunk_kda, l2norm, naive_recurrent_kda, triton_scan2
from k3.kernels.kda import triton_chunk as fwd
from k3.kernels.kda import triton_chunk_bwd as bwd
from k3.kernels.testing import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("triton_kda_backward")  # tests/kernels/conftest.py

CASES = [  # (B, T, H, HV, K, V, chunk_size, SEGMENT, h0)
    (1, 150, 1, 2, 32, 32, 16, 2, True),  # 10 chunks in segments of 2: the last segment one partial chunk
    (2, 70, 1, 2, 32, 64, 16, 1, False),  # two sequences, one chunk per segment, no initial state
    (1, 100, 1, 1, 100, 60, 32, 2, True),  # K and V masked (the transition pass at V = K = 100)
    (1, 140, 1, 2, 32, 32, 64, 1, True),  # 64-token chunks: 3 segments, the last partial
]


def _inputs(B, T, H, HV, K, V):
    torch.manual_seed(0)
    q, k = l2norm(torch.rand(B, T, H, K)), l2norm(torch.rand(B, T, H, K))
    # mild decays (g about -0.05): the state entering a segment still matters at its end, so do A_s and h0
    v, g = torch.rand(B, T, HV, V), F.logsigmoid(torch.randn(B, T, HV, K) + 3.0)
    beta, h0 = torch.randn(B, T, HV).sigmoid(), torch.randn(B, HV, K, V)
    return [x.to(DEV) for x in (q, k, v, g, beta, h0)]


def _run(monkeypatch, launch_spy, xs, segment, *, BT, h0):
    """chunk_kda with SEGMENT = segment: (o, final state, h entering each chunk, gradients of a fixed loss,
    the number of scan launches)."""
    monkeypatch.setitem(fwd.LAUNCH["scan"], "SEGMENT", segment)
    for mod in (fwd, bwd):
        monkeypatch.setattr(mod, "device_sms", lambda dev: 1000)
    scans, bwd_scans = launch_spy(fwd, "_scan_kernel"), launch_spy(bwd, "_bwd_scan_kernel")
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    kw = {"initial_state": leaves[5] if h0 else None, "output_final_state": True, "chunk_size": BT,
          "safe_gate": True, "lower_bound": -5.0}
    with torch.no_grad():
        h = chunk_kda(*leaves[:5], return_intermediate_states=True, **kw)[2]
    o, s = chunk_kda(*leaves[:5], **kw)
    torch.manual_seed(1)
    loss = (o * torch.randn(o.shape).to(DEV)).sum() + (s * torch.randn(s.shape).to(DEV)).sum()
    grads = torch.autograd.grad(loss, leaves if h0 else leaves[:5])
    return o.detach(), s.detach(), h, grads, (len(scans), len(bwd_scans))


@pytest.mark.parametrize("B,T,H,HV,K,V,BT,seg,h0", CASES, ids=[
    f"B{c[0]}-T{c[1]}-HV{c[3]}-K{c[4]}-V{c[5]}-BT{c[6]}-seg{c[7]}{'-h0' if c[8] else ''}" for c in CASES])
def test_two_level_scan_matches_one_level_and_recurrence(B, T, H, HV, K, V, BT, seg, h0, monkeypatch, launch_spy):
    xs = _inputs(B, T, H, HV, K, V)
    one = _run(monkeypatch, launch_spy, xs, 0, BT=BT, h0=h0)
    two = _run(monkeypatch, launch_spy, xs, seg, BT=BT, h0=h0)
    # one level: a scan per forward (3 forwards: the states run, the training forward, the backward's recompute) and
    # one reverse scan; two levels: three each (segment states, segment transitions, the scan from composed states)
    assert (one[4], two[4]) == ((3, 1), (9, 3))
    # fp32 throughout: the composed segment maps agree with the chunk-by-chunk scan to rounding (|diff| <= 1e-6 seen
    # under the interpreter); a transposed transition matrix moves o by 3e-4 to 6e-3 in these cases
    pairs = [("o", one[0], two[0]), ("final state", one[1], two[1]), ("h entering each chunk", one[2], two[2])]
    pairs += list(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), one[3], two[3], strict=False))
    for name, a, b in pairs:
        err = (a.double() - b.double()).abs().max().item()
        assert err <= 5e-6, f"{name}: two levels differ from one by {err:.2e}"
    leaves = [x.double().cpu().requires_grad_() for x in xs]
    ro, rs = [], []
    for n in range(B):
        o, s = naive_recurrent_kda(*(x[n:n + 1] for x in leaves[:5]), initial_state=leaves[5][n:n + 1] if h0 else None,
                                   output_final_state=True)
        ro.append(o)
        rs.append(s)
    assert_close("o (two levels)", torch.cat(ro), two[0], 0.005)  # kda.md 6.2 "chunk"
    assert_close("final state (two levels)", torch.cat(rs), two[1], 0.005)


def test_two_level_scan_only_for_few_long_fixed_length_sequences(monkeypatch):
    """use_two_level: SEGMENT set, fixed-length sequences of more than one segment, fewer programs than SMs."""
    monkeypatch.setitem(fwd.LAUNCH["scan"], "SEGMENT", 4)
    assert triton_scan2.use_two_level(1, 16, 128, 1024, 32, 132, varlen=False)  # (1, 65536, 16, 128): 64 programs
    assert not triton_scan2.use_two_level(8, 16, 128, 64, 64, 132, varlen=False)  # 256 programs
    assert not triton_scan2.use_two_level(1, 16, 128, 1024, 32, 132, varlen=True)
    assert not triton_scan2.use_two_level(1, 16, 128, 4, 32, 132, varlen=False)  # one segment
    assert not triton_scan2.use_two_level(1, 16, 128, 1024, 32, 0, varlen=False)  # no GPU
    monkeypatch.setitem(fwd.LAUNCH["scan"], "SEGMENT", 0)
    assert not triton_scan2.use_two_level(1, 16, 128, 1024, 32, 132, varlen=False)


def test_segment_layout():
    cu, host, P = triton_scan2.segment_layout(2, 70, 16, 2, "cpu")
    assert (host, P) == ([0, 32, 64, 70, 102, 134, 140], 3)
    assert cu.tolist() == host and cu.dtype == torch.int32
