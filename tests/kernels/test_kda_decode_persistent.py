"""The decode step as a persistent kernel (triton_recurrent.LAUNCH["PERSIST"], `_decode_step_kernel`): one token
per sequence, the state pool read and written in place by slot, each program walking the state tiles with a stride
of the grid. Checked against the float64 PyTorch twin (fused_recurrent_kda_torch, which test_kda.py checks against
the recurrence) and against the one-program-per-tile kernel, bit for bit under the interpreter. Outputs come from
torch.empty, NaN-poisoned by tests/conftest.py. On a CPU (Triton's interpreter) the grid is LAUNCH["PERSIST"]
programs, fewer than the tiles, so every program walks several.
"""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

# after the skip; conftest imported the kernel modules under the interpreter on a CPU
from k3.kernels.kda import fused_recurrent_kda, l2norm, triton_recurrent
from k3.kernels.kda.fused_recurrent import fused_recurrent_kda_torch
from k3.kernels.testing import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("triton_kda_backward")  # tests/kernels/conftest.py (K3_KERNELS=triton)

CASES = [  # (B sequences, H, HV, K, V, BV, state_v_first, in-kernel gate: None / "softplus" / "lower_bound")
    (3, 1, 2, 32, 128, 32, False, None),  # 4 V blocks per head: 24 tiles over 3 programs
    (3, 1, 2, 100, 60, 32, True, "lower_bound"),  # K, V masked; V-first pool; the lower-bound gate, A_log, dt_bias
    (2, 2, 4, 64, 64, 64, False, "softplus"),  # GVA; one V block per head
]


def _step(B, H, HV, K, V, gate, pool, idx, state_v_first, fn):
    """One decode step by `fn` (the public op, or the float64 twin on float64 copies); returns its output."""
    torch.manual_seed(1)
    q, k = torch.rand(B, 1, H, K), torch.rand(B, 1, H, K)
    v, beta = torch.rand(B, 1, HV, V), torch.randn(B, 1, HV)
    g = torch.randn(B, 1, HV, K) if gate else torch.nn.functional.logsigmoid(torch.randn(B, 1, HV, K))
    if not gate:
        q, k, beta = l2norm(q), l2norm(k), beta.sigmoid()
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * K)
    dt = pool.dtype
    xs = [x.to(DEV, dt) for x in (q, k, v, g, beta)]
    kw = {"A_log": A_log.to(DEV, dt) if gate else None, "dt_bias": dt_bias.to(DEV, dt) if gate else None,
          "use_qk_l2norm_in_kernel": bool(gate), "use_gate_in_kernel": bool(gate),
          "use_beta_sigmoid_in_kernel": bool(gate), "lower_bound": -5.0 if gate == "lower_bound" else None,
          "initial_state": pool, "ssm_state_indices": idx, "state_v_first": state_v_first}
    if fn is fused_recurrent_kda_torch:
        return fn(*xs, scale=None, output_final_state=False, cu_seqlens=None, num_accepted_tokens=None, **kw)[0]
    return fn(*xs, **kw)[0]


@pytest.mark.parametrize("B,H,HV,K,V,BV,vfirst,gate", CASES, ids=[
    f"B{c[0]}-H{c[1]}-HV{c[2]}-K{c[3]}-V{c[4]}-BV{c[5]}{'-vfirst' if c[6] else ''}-{c[7] or 'no-gate'}"
    for c in CASES])
def test_persistent_decode_step_matches_twin_and_tile_kernel(B, H, HV, K, V, BV, vfirst, gate, monkeypatch,
                                                             launch_spy):
    monkeypatch.setitem(triton_recurrent.LAUNCH, "BV", BV)
    shape = (6, HV, V, K) if vfirst else (6, HV, K, V)
    torch.manual_seed(0)
    pool0 = torch.randn(shape).to(DEV)
    idx = torch.tensor([4, -1, 0][:B], dtype=torch.int32, device=DEV)  # -1: start from zeros, write nothing
    ref_pool = pool0.double().cpu()
    ro = _step(B, H, HV, K, V, gate, ref_pool, idx.cpu(), vfirst, fused_recurrent_kda_torch)
    outs = {}
    for persist in (0, 3):
        monkeypatch.setitem(triton_recurrent.LAUNCH, "PERSIST", persist)
        runs = launch_spy(triton_recurrent, "_decode_step_kernel")
        tiles = launch_spy(triton_recurrent, "_recurrent_kda_kernel")
        pool = pool0.clone()
        o = _step(B, H, HV, K, V, gate, pool, idx, vfirst, fused_recurrent_kda)
        assert (len(runs), len(tiles)) == ((1, 0) if persist else (0, 1))
        if persist and DEV == "cpu":  # no multiprocessor count: PERSIST programs, each walking several tiles
            assert runs[0] == (3,) and B * HV * -(-V // BV) > 3
        assert_close(f"o (PERSIST={persist})", ro, o, 1e-5)
        written = {int(s) for s in idx if s >= 0}
        for slot in range(6):
            if slot in written:
                assert_close(f"pool[{slot}]", ref_pool[slot], pool[slot], 1e-5)
            else:
                assert torch.equal(pool[slot], pool0[slot]), f"pool slot {slot} was written"
        outs[persist] = (o, pool)
    if DEV == "cpu":  # the same operations in the same order
        assert torch.equal(outs[0][0], outs[3][0]) and torch.equal(outs[0][1], outs[3][1])


@pytest.mark.parametrize("case", ["two_tokens", "per_token_slots", "final_state"])
def test_persistent_decode_leaves_other_calls_to_the_tile_kernel(case, monkeypatch, launch_spy):
    """Only the plain decode step (T = 1, slots, no draft slots, no final state, no varlen) takes the persistent
    kernel; everything else runs the one-program-per-tile kernel."""
    monkeypatch.setitem(triton_recurrent.LAUNCH, "PERSIST", 3)
    runs = launch_spy(triton_recurrent, "_decode_step_kernel")
    tiles = launch_spy(triton_recurrent, "_recurrent_kda_kernel")
    T = 2 if case != "final_state" else 1
    q, k = l2norm(torch.rand(2, T, 1, 32)).to(DEV), l2norm(torch.rand(2, T, 1, 32)).to(DEV)
    v, beta = torch.rand(2, T, 1, 32).to(DEV), torch.rand(2, T, 1).to(DEV)
    g = torch.nn.functional.logsigmoid(torch.randn(2, T, 1, 32)).to(DEV)
    pool = torch.randn(4, 1, 32, 32).to(DEV)
    if case == "per_token_slots":
        idx = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEV)
        fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx,
                            num_accepted_tokens=torch.tensor([1, 2], dtype=torch.int32, device=DEV))
    else:
        idx = torch.tensor([0, 2], dtype=torch.int32, device=DEV)
        fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx,
                            output_final_state=case == "final_state")
    assert (len(runs), len(tiles)) == (0, 1)
