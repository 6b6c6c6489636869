"""The forward's output computed inside the state scan (launch.fuse_output: `_scan_kernel` with OUTPUT, no
states or v_new stored; qg = scale q exp2(Gamma) from the intra kernel) against the float64 recurrence, and against
the separate output kernel it replaces.

Both paths are forced through LAUNCH["scan"]["OUTPUT_FROM"] (0: always fused; 2**30: never), whatever the default
is, and a launch spy proves which one ran. Outputs come from torch.empty, NaN-poisoned by tests/conftest.py, so a
row or V block the fused scan fails to write fails the comparison. On a CPU under Triton's interpreter (tiny shapes),
on a GPU natively (fp32).
"""

import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

# after the skip; conftest imported the kernel modules under the interpreter on a CPU
from k3.kernels.kda import chunk_kda, l2norm, naive_recurrent_kda
from k3.kernels.kda.triton import chunk_bwd as bwd_mod
from k3.kernels.kda.triton import chunk_fwd as fwd_mod
from k3.kernels.kda.triton import launch as launch_mod
from k3.kernels.testing import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NEVER = 1 << 30
# bf16 on a GPU only (the interpreter's bf16 dots are not the GPU's); bf16 ratios as test_kda_triton.ratio_for
DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]

pytestmark = pytest.mark.usefixtures("triton_kda_backward")  # tests/kernels/conftest.py

CASES = [  # (T, H, HV, K, V, chunk_size, safe_gate, h0, cu_seqlens)
    (70, 1, 2, 32, 32, 64, True, True, None),  # a partial chunk
    (45, 1, 2, 100, 60, 32, False, False, None),  # K and V masked (next_pow2 128 / 64), exact gate, no h0
    (40, 1, 2, 32, 64, 16, True, True, None),  # one sub-chunk per chunk
    (80, 1, 2, 32, 32, 64, True, True, [0, 15, 15, 80]),  # varlen with an empty sequence
    (50, 2, 4, 32, 32, 32, True, False, None),  # GVA: 2 value heads per q/k head
]


def _inputs(T, H, HV, K, V, N, dtype=torch.float32):
    """q, k, v, beta in `dtype`; g and h0 fp32 (as chunk_kda's callers pass them)."""
    torch.manual_seed(0)
    q, k = l2norm(torch.rand(1, T, H, K)), l2norm(torch.rand(1, T, H, K))
    v, g = torch.rand(1, T, HV, V), F.logsigmoid(torch.randn(1, T, HV, K)).clamp_min(-5.0)
    beta, h0 = torch.randn(1, T, HV).sigmoid(), torch.randn(N, HV, K, V)
    return [x.to(DEV, dtype) for x in (q, k, v)] + [g.to(DEV), beta.to(DEV, dtype), h0.to(DEV)]


def _run(monkeypatch, launch_spy, xs, output_from, *, BT, safe, h0, cu, grad=False):
    """chunk_kda with LAUNCH["scan"]["OUTPUT_FROM"] = output_from; returns (o, final state, the output kernel's
    launches, and with `grad` the gradients of a fixed random loss w.r.t. q, k, v, g, beta, h0)."""
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "OUTPUT_FROM", output_from)
    launches = launch_spy(fwd_mod, "_output_kernel")
    leaves = [x.detach().clone().requires_grad_(grad) for x in xs]
    o, s = chunk_kda(*leaves[:5], initial_state=leaves[5] if h0 else None, output_final_state=True, chunk_size=BT,
                     safe_gate=safe, lower_bound=-5.0 if safe else None,
                     cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV))
    grads = None
    if grad:
        torch.manual_seed(1)
        loss = (o * torch.randn(o.shape).to(DEV)).sum() + (s * torch.randn(s.shape).to(DEV)).sum()
        grads = torch.autograd.grad(loss, leaves if h0 else leaves[:5])
    return o.detach(), s.detach(), list(launches), grads


def _naive(xs, h0, cu):
    """float64 recurrence per sequence: (o [1, T, HV, V], final states [N, HV, K, V])."""
    q, k, v, g, beta, s0 = (x.double().cpu() for x in xs)
    HV = v.shape[2]
    q, k = (x.repeat_interleave(HV // x.shape[2], dim=2) for x in (q, k))
    bounds = [0, q.shape[1]] if cu is None else cu
    outs, states = [], []
    for n, (a, b) in enumerate(itertools.pairwise(bounds)):
        o, s = naive_recurrent_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                   initial_state=s0[n:n + 1] if h0 else None, output_final_state=True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("T,H,HV,K,V,BT,safe,h0,cu", CASES, ids=[
    f"T{c[0]}-H{c[1]}-HV{c[2]}-K{c[3]}-V{c[4]}-BT{c[5]}-{'safe' if c[6] else 'exact'}{'-h0' if c[7] else ''}"
    f"{'-varlen' if c[8] else ''}" for c in CASES])
def test_fused_output_matches_recurrence_and_output_kernel(T, H, HV, K, V, BT, safe, h0, cu, dtype, monkeypatch,
                                                           launch_spy):
    xs = _inputs(T, H, HV, K, V, 1 if cu is None else len(cu) - 1, dtype)
    lo, same = (0.005, 1e-6) if dtype == torch.float32 else (0.01, 0.01)  # kda.md 6.2 "chunk"; bf16 output rounding
    o_u, s_u, split_launches, _ = _run(monkeypatch, launch_spy, xs, NEVER, BT=BT, safe=safe, h0=h0, cu=cu)
    assert len(split_launches) == 1
    ro, rs = _naive(xs, h0, cu)
    o_f, s_f, fused_launches, _ = _run(monkeypatch, launch_spy, xs, 0, BT=BT, safe=safe, h0=h0, cu=cu)
    assert fused_launches == []
    assert_close("o (fused)", ro, o_f, lo)
    assert_close("ht (fused)", rs, s_f, lo)
    assert_close("o (fused vs output kernel)", o_u, o_f, same)
    assert torch.equal(s_f, s_u), "the final state must not depend on where the output is computed"


def test_fused_forward_changes_no_gradient(monkeypatch, launch_spy):
    """A training forward with the fused output saves the same Gamma, Aqk, Akk and M (the backward recomputes the
    states), so every gradient equals the split forward's bit for bit, and matches the recurrence's."""
    T, H, HV, K, V, BT = 70, 1, 2, 32, 32, 64
    xs = _inputs(T, H, HV, K, V, 1)
    o_f, _, fused_launches, g_f = _run(monkeypatch, launch_spy, xs, 0, BT=BT, safe=True, h0=True, cu=None, grad=True)
    o_u, _, split_launches, g_u = _run(monkeypatch, launch_spy, xs, NEVER, BT=BT, safe=True, h0=True, cu=None,
                                       grad=True)
    assert fused_launches == [] and len(split_launches) == 1
    assert_close("o (fused vs output kernel)", o_u, o_f, 1e-6)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g_f, g_u, strict=True):
        assert torch.equal(a, b), f"{name} differs between the fused and the split forward"
    leaves = [x.double().cpu().requires_grad_() for x in xs]
    o, s = naive_recurrent_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    torch.manual_seed(1)
    loss = (o * torch.randn(o.shape).double()).sum() + (s * torch.randn(s.shape).double()).sum()
    for name, r, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), torch.autograd.grad(loss, leaves), g_f,
                          strict=True):
        assert_close(name, r, x, 0.02)  # kda.md 6.2 "chunk" (dg, dbeta: 0.02; the others 0.008)


def test_intermediate_states_keep_the_output_kernel(monkeypatch, launch_spy):
    """return_intermediate_states needs the states entering each chunk: the scan stores them and the output
    kernel runs, even when fusing is on for every launch."""
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "OUTPUT_FROM", 0)
    launches = launch_spy(fwd_mod, "_output_kernel")
    q, k, v, g, beta, h0 = _inputs(70, 1, 2, 32, 32, 1)
    o, _, h = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, safe_gate=True,
                        lower_bound=-5.0, return_intermediate_states=True)
    assert len(launches) == 1 and h.shape == (1, 2, 2, 32, 32) and torch.isfinite(h).all()
    ro, _ = _naive([q, k, v, g, beta, h0], True, None)
    assert_close("o", ro, o, 0.005)


def test_fuse_output_threshold(monkeypatch):
    """fuse_output compares the scan's program count (sequences x value heads x V blocks) with OUTPUT_FROM."""
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "BV", 64)
    cpu = torch.device("cpu")  # no multiprocessor count: the scan keeps LAUNCH's V block
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "OUTPUT_FROM", 64)
    assert launch_mod.fuse_output(8, 4, 128, 128, cpu)  # 8 x 4 x 2 = 64 programs
    assert not launch_mod.fuse_output(8, 4, 64, 128, cpu)  # 32 programs
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "OUTPUT_FROM", 0)
    assert launch_mod.fuse_output(1, 1, 16, 16, cpu)


@pytest.mark.parametrize("recompute", ["0", "1"], ids=["keep-states", "recompute"])
def test_scan_v_block_16_with_few_sequences(monkeypatch, launch_spy, recompute, kernel_env):
    """With fewer scan programs than multiprocessors the scans halve their V block down to 16 (scan_v_block). The
    interpreter has no multiprocessor count, so one is patched in: the forward scan (with the output, storing the
    states the backward keeps by default), the backward's recompute (K3_KDA_RECOMPUTE=1) and its reverse scan then
    run 16-wide V blocks, and the output, final state and every gradient equal the one-block launch's (V blocks are
    independent columns of the state) and match the float64 recurrence."""
    kernel_env(K3_KDA_RECOMPUTE=recompute)

    T, H, HV, K, V, BT = 70, 1, 2, 32, 64, 64
    xs = _inputs(T, H, HV, K, V, 1)
    o_1, s_1, _, g_1 = _run(monkeypatch, launch_spy, xs, 0, BT=BT, safe=True, h0=True, cu=None, grad=True)
    for mod in (fwd_mod, launch_mod, bwd_mod):  # each looks device_sms up as its own global
        monkeypatch.setattr(mod, "device_sms", lambda dev: 132)  # an H200's count: 1 x 2 x 64 / 16 = 8 programs
    scans, bwd_scans = launch_spy(fwd_mod, "_scan_kernel"), launch_spy(bwd_mod, "_bwd_scan_kernel")
    o_4, s_4, _, g_4 = _run(monkeypatch, launch_spy, xs, 0, BT=BT, safe=True, h0=True, cu=None, grad=True)
    # forward (and the recompute); V / 16 blocks
    assert scans == [(4, 1, HV)] * (1 + int(recompute)) and bwd_scans == [(4, 1, HV)]
    assert_close("o (V block 16)", o_1, o_4, 1e-6)
    assert_close("ht (V block 16)", s_1, s_4, 1e-6)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g_1, g_4, strict=True):
        assert_close(f"{name} (V block 16)", a, b, 1e-6)
    ro, rs = _naive(xs, True, None)
    assert_close("o (V block 16 vs recurrence)", ro, o_4, 0.005)
    assert_close("ht (V block 16 vs recurrence)", rs, s_4, 0.005)
