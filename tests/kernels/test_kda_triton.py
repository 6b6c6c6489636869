"""Triton KDA kernels (K3_KERNELS=triton) vs the float64 naive recurrence (kda.md section 6).

On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set per test), so shapes are tiny: T <= 80,
H <= 2, D in {32, 60}. Gradients (Triton chunk backward, triton/chunk_bwd.py) are checked against autograd through
the float64 recurrence with the kda.md 6.2 thresholds. On a CUDA machine the same tests run on the GPU in fp32 and
bf16. Outputs are allocated with torch.empty, which conftest NaN-poisons, so any element a kernel fails to write fails
the comparison.
Metric (kda.md 6.1): pass if max |ref - out| <= 1e-6, else no NaN and rms(ref - out) / (rms(ref) + 1e-8) < ratio.
"""

import importlib
import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

CUDA = torch.cuda.is_available()


# triton and the kernel modules were imported under the interpreter by tests/kernels/conftest.py

import itertools

from k3.kernels import dispatch
from k3.kernels.dispatch import triton_interpreter
from k3.kernels.kda import (
    chunk_kda,
    fused_recurrent_kda,
    l2norm,
    naive_kda_gate,
    naive_kda_lowerbound_gate,
    naive_recurrent_kda,
)
from k3.kernels.kda.fused_recurrent import fused_recurrent_kda_torch
from k3.kernels.kda.triton import chunk_bwd as bwd_mod
from k3.kernels.kda.triton import chunk_fwd as fwd_mod
from k3.kernels.kda.triton import common as common_mod
from k3.kernels.kda.triton import launch as launch_mod
from k3.kernels.kda.triton import norm as norm_mod
from k3.kernels.kda.triton import recurrent as rec_mod
from k3.kernels.testing import assert_close

DEV = "cuda" if CUDA else "cpu"
F64 = torch.float64
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]


@pytest.fixture(autouse=True)
def _triton_backend(triton_cpu, kernel_env):
    """K3_KERNELS=triton for the public ops (on a CPU under Triton's interpreter: conftest's triton_cpu), with the
    Triton backward. Restored after each test."""
    kernel_env(K3_KERNELS="triton", K3_KDA_BWD="triton")
    assert dispatch.kernel_backend() == "triton"


def make_inputs(B, T, H, HV, K, V, dtype, N=None):
    """fla recipe (kda.md 6.2), drawn on the CPU in fp32: q, k ~ U(0,1) L2-normalized, v ~ U(0,1),
    g = logsigmoid(N(0,1)), beta = sigmoid(N(0,1)); h0 ~ N(0,1) fp32. Inputs cast to `dtype` on DEV."""
    q = l2norm(torch.rand(B, T, H, K))
    k = l2norm(torch.rand(B, T, H, K))
    v = torch.rand(B, T, HV, V)
    g = F.logsigmoid(torch.randn(B, T, HV, K))
    beta = torch.randn(B, T, HV).sigmoid()
    h0 = torch.randn(N or B, HV, K, V)
    q, k, v, beta = (x.to(DEV, dtype) for x in (q, k, v, beta))
    return q, k, v, g.to(DEV), beta, h0.to(DEV)


def naive64(q, k, v, g, beta, h0, cu=None):
    """float64 recurrence on the CPU; varlen by a loop over sequences. Returns (o [B, T, HV, V], ht [N, HV, K, V])."""
    args = [x.detach().double().cpu() if x is not None else None for x in (q, k, v, g, beta, h0)]
    return naive_varlen(*args, cu)


def raw_qk_inputs(D, V, dtype):
    """Inputs for the forward with the q / k L2 norm in the kernel: one sequence of 70 tokens (a partial chunk), 2
    heads, raw q, k rows of norm far from 1, g >= -5 (the safe gate), and the float64 reference (o, ht) on the
    normalised q, k. Returns (q, k, v, g, beta, h0, ref_o, ref_ht)."""
    q, k, v, g, beta, h0 = make_inputs(1, 70, 2, 2, D, V, dtype)
    q, k, g = (3 * q).to(dtype), (0.5 * k).to(dtype), g.clamp_min(-5.0)
    ro, rs = naive64(*(x.double() / x.double().norm(dim=-1, keepdim=True) for x in (q, k)), v, g, beta, h0)
    return q, k, v, g, beta, h0, ro, rs


def naive_varlen(q, k, v, g, beta, h0, cu=None):
    """The recurrence on the given tensors (autograd flows through them); varlen by a loop over sequences."""
    if cu is None:
        return naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    outs, states = [], []
    for n, (a, b) in enumerate(itertools.pairwise(cu)):
        o, s = naive_recurrent_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                   initial_state=None if h0 is None else h0[n : n + 1], output_final_state=True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states)


def case_id(B, T, H, HV, D):
    return f"B{B}-T{T}-H{H}-HV{HV}-D{D}"


def ratio_for(dtype, fp32_ratio):
    return fp32_ratio if dtype == torch.float32 else max(fp32_ratio, 0.01)


# ---------------------------------------------------------------------------------------------- fused recurrent


REC_CASES = [(2, 5, 1, 2, 32), (1, 1, 2, 2, 60), (1, 9, 1, 1, 60)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("B,T,H,HV,D", REC_CASES, ids=[case_id(*c) for c in REC_CASES])
def test_recurrent_matches_naive(B, T, H, HV, D, dtype):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, D, D, dtype)
    ro, rs = naive64(q, k, v, g, beta, h0)
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == v.dtype and s.dtype == torch.float32
    assert_close("o", ro, o, ratio_for(dtype, 0.005))
    assert_close("ht", rs, s, ratio_for(dtype, 0.005))
    o0, s0 = fused_recurrent_kda(q, k, v, g, beta, output_final_state=False)  # no initial state, no final state
    assert s0 is None
    assert_close("o (h0 = 0)", naive64(q, k, v, g, beta, None)[0], o0, ratio_for(dtype, 0.005))


@pytest.mark.parametrize("B,T,H,HV,D", REC_CASES, ids=[case_id(*c) for c in REC_CASES])
def test_recurrent_pool_by_reversed_slots_matches_naive(B, T, H, HV, D):
    """The kernel's step (error and output from the state before it, o = S^T (d q) + (beta k.q) err, then the update)
    through a pool by slot, sequence b in slot B - b: outputs and the slots as the float64 recurrence's, fp32 (the
    same cases without a pool: test_recurrent_matches_naive)."""
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, D, D, torch.float32)
    ro, rs = naive64(q, k, v, g, beta, h0)
    pool = torch.cat([torch.zeros_like(h0[:1]), h0.flip(0)])  # slot n + ... : sequence b in slot B - b
    idx = torch.arange(B, 0, -1, dtype=torch.int32, device=DEV)
    o, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx)
    assert_close("o (pool)", ro, o, 0.005)
    assert_close("pool", rs, pool[1:].flip(0), 0.005)


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_recurrent_in_kernel_flags(gate):
    B, T, H, HV, D = 1, 6, 1, 2, 60
    q, k, v, _, _, h0 = make_inputs(B, T, H, HV, D, D, torch.float32)
    q, k = torch.rand_like(q), torch.rand_like(k)  # raw: normalized in the kernel
    z = torch.randn(B, T, HV, D, device=DEV)
    b_logit = torch.randn(B, T, HV, device=DEV)
    A_log, dt_bias = torch.randn(HV, device=DEV), torch.randn(HV * D, device=DEV)
    lb = -5.0 if gate == "lower_bound" else None
    o, s = fused_recurrent_kda(q, k, v, z, b_logit, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                               output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, lower_bound=lb)
    z64, A64, b64 = z.double().cpu(), A_log.double().cpu(), dt_bias.double().cpu()
    g = naive_kda_lowerbound_gate(z64, A64, b64, lb) if lb is not None else naive_kda_gate(z64, A64, b64)
    ro, rs = naive64(l2norm(q.double()), l2norm(k.double()), v, g, b_logit.double().sigmoid(), h0)
    assert_close("o", ro, o, 0.002)
    assert_close("ht", rs, s, 0.002)


def test_recurrent_varlen():
    cu = [0, 3, 3, 10]  # includes an empty sequence
    q, k, v, g, beta, h0 = make_inputs(1, 10, 1, 2, 32, 32, torch.float32, N=3)
    ro, rs = naive64(q, k, v, g, beta, h0, cu)
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                               cu_seqlens=torch.tensor(cu, device=DEV))
    assert_close("o", ro, o, 0.005)
    assert_close("ht", rs, s, 0.005)


@pytest.mark.parametrize("wide", [False, True], ids=["bv32", "bv64"])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_recurrent_state_pool_in_place(state_v_first, wide, monkeypatch):
    """Pool slots read and written in place; `wide`: the V block of large batches (recurrent.BV_WIDE, one
    masked block over V = 60) instead of two blocks of 32."""

    monkeypatch.setattr(rec_mod, "WIDE_FROM", 1 if wide else 1 << 30)
    B, T, HV, D = 3, 2, 2, 60
    q, k, v, g, beta, _ = make_inputs(B, T, 1, HV, D, D, torch.float32)
    pool = torch.randn(5, HV, D, D, device=DEV)  # [P, HV, K, V] (read as V-first when state_v_first)
    before = pool.clone()
    idx = torch.tensor([3, -1, 0], device=DEV, dtype=torch.int32)  # -1: start from zeros, write nothing
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx, output_final_state=True,
                               state_v_first=state_v_first)
    h0 = before[[3, 0, 0]].clone()
    h0[1] = 0.0
    h0 = h0.transpose(-1, -2) if state_v_first else h0
    ro, rs = naive64(q, k, v, g, beta, h0)
    rs_layout = rs.transpose(-1, -2) if state_v_first else rs
    assert_close("o", ro, o, 0.005)
    assert_close("ht", rs_layout, s, 0.005)
    assert_close("pool[3]", rs_layout[0], pool[3], 0.005)
    assert_close("pool[0]", rs_layout[2], pool[0], 0.005)
    for untouched in (1, 2, 4):
        assert torch.equal(pool[untouched], before[untouched]), f"pool slot {untouched} changed"


def test_recurrent_speculative_slots_match_torch():
    """num_accepted_tokens: same semantics as the PyTorch twin (which test_kda.py checks against the recurrence)."""
    N, S_max, HV, D = 2, 3, 2, 32
    q, k, v, g, beta, _ = make_inputs(N, S_max, 1, HV, D, D, torch.float32)
    pool = torch.randn(8, HV, D, D, device=DEV)
    idx = torch.tensor([[0, 1, 2], [5, -1, 6]], device=DEV, dtype=torch.int32)
    nat = torch.tensor([2, 1], device=DEV, dtype=torch.int32)
    pool_ref = pool.clone()
    kw = {"A_log": None, "dt_bias": None, "scale": None, "output_final_state": True, "use_qk_l2norm_in_kernel": False,
          "use_gate_in_kernel": False, "use_beta_sigmoid_in_kernel": False, "lower_bound": None, "cu_seqlens": None,
          "state_v_first": False}
    ro, _ = fused_recurrent_kda_torch(q, k, v, g, beta, initial_state=pool_ref, ssm_state_indices=idx,
                                      num_accepted_tokens=nat, **kw)
    o, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=nat,
                               output_final_state=True)
    assert_close("o", ro, o, 1e-5)
    for slot in range(8):
        if slot in (3, 4, 7):
            assert torch.equal(pool[slot], pool_ref[slot]), f"untouched slot {slot} changed"
        else:
            assert_close(f"pool[{slot}]", pool_ref[slot], pool[slot], 1e-5)


# ---------------------------------------------------------------------------------------------- chunk forward


CHUNK_CASES = [  # (B, T, H, HV, D, chunk_size, safe_gate)
    (1, 37, 1, 1, 32, 64, True),
    (1, 70, 1, 2, 60, 32, True),
    (2, 40, 1, 2, 32, 64, False),
    (1, 45, 1, 1, 128, 64, True),  # D = 128: the backward inter kernel's two K blocks of 64
    (1, 50, 1, 1, 100, 32, False),  # two K blocks, the second one masked (100 = 64 + 36)
    (1, 24, 1, 1, 64, 16, True),  # one sub-chunk per chunk: no off-diagonal columns
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("B,T,H,HV,D,BT,safe", CHUNK_CASES,
                         ids=[f"{case_id(*c[:5])}-BT{c[5]}-{'safe' if c[6] else 'exact'}" for c in CHUNK_CASES])
def test_chunk_forward_matches_naive(B, T, H, HV, D, BT, safe, dtype):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, D, D, dtype)
    ro, rs = naive64(q, k, v, g, beta, h0)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=BT, safe_gate=safe,
                     lower_bound=-5.0 if safe else None)
    assert o.dtype == v.dtype and s.dtype == torch.float32
    assert_close("o", ro, o, ratio_for(dtype, 0.005))
    assert_close("ht", rs, s, ratio_for(dtype, 0.005))


GRAD_NAMES = ["o", "ht", "dq", "dk", "dv", "dg", "db", "dh0"]
GRAD_RATIOS = [0.005, 0.005, 0.008, 0.008, 0.008, 0.02, 0.02, 0.008]  # kda.md 6.2 "chunk"
VARLEN_RATIOS = [0.005, 0.005, 0.007, 0.008, 0.007, 0.015, 0.015, 0.007]  # kda.md 6.2 "chunk varlen"


def grads_vs_naive(q, k, v, g, beta, h0, *, BT=64, safe=True, cu=None, final=True, qk_norm=False, **kw):
    """(reference, Triton) lists [o, ht, dq, dk, dv, dg, dbeta, dh0]: autograd through the float64 recurrence vs
    the Triton chunk forward + backward; loss = sum(o * do) (+ sum(ht * dht)), random do, dht (kda.md 6.2).
    qk_norm: raw q, k, L2-normalized by the float64 formula (gate.l2norm) in the reference and in the kernels
    (use_qk_l2norm_in_kernel=True)."""
    do = torch.randn(v.shape, device=DEV)
    N = q.shape[0] if cu is None else len(cu) - 1
    dht = torch.randn(N, v.shape[2], q.shape[3], v.shape[3], device=DEV)
    with_h0 = h0 is not None

    def grads(fn, xs):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        o, s = fn(*leaves)
        loss = (o * do.to(o.device, o.dtype)).sum()
        if final:
            loss = loss + (s * dht.to(s.device, s.dtype)).sum()
        return [o, s, *torch.autograd.grad(loss, leaves)]

    xs = [q, k, v, g, beta] + ([h0] if with_h0 else [])
    norm = l2norm if qk_norm else (lambda x: x)
    ref = grads(lambda *a: naive_varlen(norm(a[0]), norm(a[1]), *a[2:5], a[5] if with_h0 else None, cu),
                [x.double().cpu() for x in xs])
    cu_t = None if cu is None else torch.tensor(cu, device=DEV)
    out = grads(lambda *a: chunk_kda(*a[:5], initial_state=a[5] if with_h0 else None, output_final_state=True,
                                     chunk_size=BT, safe_gate=safe, lower_bound=-5.0 if safe else None,
                                     cu_seqlens=cu_t, use_qk_l2norm_in_kernel=qk_norm, **kw), xs)
    return ref, out


GRAD_CASES = [  # (B, T, H, HV, D, chunk_size, safe_gate, initial state, loss through the final state)
    (1, 40, 1, 2, 32, 64, True, True, True),
    (2, 70, 1, 2, 60, 32, True, False, False),
    (1, 33, 2, 4, 32, 16, False, True, True),
    (1, 21, 1, 1, 60, 64, False, True, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("B,T,H,HV,D,BT,safe,h0,final", GRAD_CASES,
                         ids=[f"{case_id(*c[:5])}-BT{c[5]}-{'safe' if c[6] else 'exact'}-{'h0' if c[7] else 'noh0'}-"
                              f"{'dht' if c[8] else 'nodht'}" for c in GRAD_CASES])
def test_chunk_gradients_match_naive(B, T, H, HV, D, BT, safe, h0, final, dtype):
    """Triton forward + Triton backward: gradients of q, k, v, g, beta and h0 vs autograd through the recurrence."""
    q, k, v, g, beta, s0 = make_inputs(B, T, H, HV, D, D, dtype)
    ref, out = grads_vs_naive(q, k, v, g, beta, s0 if h0 else None, BT=BT, safe=safe, final=final)
    assert [x.dtype for x in out[2:]] == [q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, torch.float32][: len(out) - 2]
    for name, r, x, ratio in zip(GRAD_NAMES, ref, out, GRAD_RATIOS, strict=False):
        assert_close(name, r, x, ratio_for(dtype, ratio))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_chunk_gradients_wide_heads(dtype):
    """K = V = 256 (the widest head the kernels take): the w/u kernel in two K blocks, the scans at V block 32 (and on
    an H200 possibly at 1 stage: common.launch_fitting), the backward inter kernel in four K blocks; outputs
    and every gradient against the float64 recurrence."""
    q, k, v, g, beta, h0 = make_inputs(1, 100, 1, 1, 256, 256, dtype)  # two chunks: the halves carried across
    ref, out = grads_vs_naive(q, k, v, g, beta, h0)
    for name, r, x, ratio in zip(GRAD_NAMES, ref, out, GRAD_RATIOS, strict=True):
        assert_close(name, r, x, ratio_for(dtype, ratio))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("K,V", [(128, 64), (64, 128), (32, 256), (256, 32), (64, 32), (128, 32)])
def test_chunk_gradients_unequal_key_and_value_dims(K, V, dtype):
    """K != V: each kernel takes its K-side launch (the forward intra kernel's K <= 64 warps, the backward intra
    kernel's K blocks, the reverse scan's K halves above 128) and V-side blocks (the scans' and inter kernel's V
    blocks) independently. In bf16 on a GPU too: V = 32 there once put the w/u kernel at V block 32, which the H200
    miscompiles (launch.v_block)."""
    q, k, v, g, beta, h0 = make_inputs(1, 70, 1, 2, K, V, dtype)
    ref, out = grads_vs_naive(q, k, v, g, beta, h0)
    for name, r, x, ratio in zip(GRAD_NAMES, ref, out, GRAD_RATIOS, strict=True):
        assert_close(name, r, x, ratio_for(dtype, ratio))


def test_chunk_gradients_varlen():
    """cu_seqlens with an empty sequence and a partial last chunk; dh0 per sequence."""
    cu = [0, 15, 15, 80]
    q, k, v, g, beta, h0 = make_inputs(1, 80, 1, 2, 32, 32, torch.float32, N=3)
    ref, out = grads_vs_naive(q, k, v, g, beta, h0, cu=cu)
    for name, r, x, ratio in zip(GRAD_NAMES, ref, out, VARLEN_RATIOS, strict=True):
        assert_close(name, r, x, ratio)


def test_chunk_gradients_extreme_gates_exact_path():
    """g = -1000 entries on the unbounded path: the backward's exact diagonal terms stay finite and correct."""
    q, k, v, g, beta, h0 = make_inputs(1, 24, 1, 1, 32, 32, torch.float32)
    g = g.clone()
    g[0, 3, 0, :7] = -1000.0
    g[0, 17, 0, 5:] = -1000.0
    ref, out = grads_vs_naive(q, k, v, g, beta, h0, safe=False)
    for name, r, x, ratio in zip(GRAD_NAMES, ref, out, GRAD_RATIOS, strict=True):
        assert_close(name, r, x, ratio)


def test_chunk_gradients_lower_bound_gates_safe_path():
    """Every g near the lower bound -5 (a 64-token chunk decays by ~160 nats): the fixed-anchor backward stays in
    fp32 range (kda.md 3.3)."""
    q, k, v, _, beta, h0 = make_inputs(1, 64, 1, 1, 32, 32, torch.float32)
    g = -5.0 + 0.5 * torch.rand(1, 64, 1, 32, device=DEV)
    ref, out = grads_vs_naive(q, k, v, g, beta, h0, safe=True)
    for name, r, x, ratio in zip(GRAD_NAMES, ref, out, GRAD_RATIOS, strict=True):
        assert_close(name, r, x, ratio)


def test_chunk_backward_switch(monkeypatch, kernel_env):
    """K3_KDA_BWD=torch (PyTorch recompute) and the Triton backward agree; a bad value is a clear error."""
    q, k, v, g, beta, h0 = make_inputs(1, 20, 1, 2, 32, 32, torch.float32)
    kernel_env(K3_KDA_BWD="torch")
    torch.manual_seed(7)  # grads_vs_naive draws do, dht: the same draws in both calls
    _, torch_bwd = grads_vs_naive(q, k, v, g, beta, h0)
    kernel_env(K3_KDA_BWD="triton")
    torch.manual_seed(7)
    _, triton_bwd = grads_vs_naive(q, k, v, g, beta, h0)
    for name, a, b in zip(GRAD_NAMES, torch_bwd, triton_bwd, strict=True):
        assert_close(name, a, b, 1e-4)
    kernel_env(K3_KDA_BWD="bogus")
    with pytest.raises(ValueError, match="K3_KDA_BWD"):
        grads_vs_naive(q, k, v, g, beta, h0)


@pytest.mark.parametrize("bwd", ["triton", "torch"])
def test_chunk_gradients_through_the_final_state_only(bwd, monkeypatch, kernel_env):
    """o unused (autograd passes no gradient for it: the Function does not materialize zeros) and the state
    buffer h unused: the gradients still match the recurrence's, on both backward paths."""
    kernel_env(K3_KDA_BWD=bwd)
    q, k, v, g, beta, h0 = make_inputs(1, 40, 1, 2, 32, 32, torch.float32)
    dht = torch.randn(1, 2, 32, 32, device=DEV)
    xs = [q, k, v, g, beta, h0]
    ref_leaves = [x.detach().double().cpu().requires_grad_() for x in xs]
    _, s_ref = naive_varlen(*ref_leaves, None)
    ref = torch.autograd.grad((s_ref * dht.double().cpu()).sum(), ref_leaves[1:])  # q does not reach the state
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    _, s, _h = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, safe_gate=True,
                         lower_bound=-5.0, return_intermediate_states=True)
    dq, *out = torch.autograd.grad((s * dht).sum(), leaves)
    assert dq.abs().max() == 0
    for name, r, x, ratio in zip(GRAD_NAMES[3:], ref, out, GRAD_RATIOS[3:], strict=True):
        assert_close(name, r, x, ratio)


@pytest.mark.parametrize("D", [32, 60, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_triton_matches_float64(D, dtype):
    """norm.l2norm_triton (one pass each way) vs the float64 formula and its autograd: output and input gradient."""

    x = (torch.randn(3, 7, 2, D) * 3).to(DEV, dtype).requires_grad_()
    dy = torch.randn(3, 7, 2, D).to(DEV, dtype)
    y = norm_mod.l2norm_triton(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    y64 = l2norm(x64)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    assert y.dtype == dtype and dx.dtype == dtype
    ratio = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close("y", y64, y, ratio)
    assert_close("dx", dx64, dx, ratio)


def test_chunk_safe_gate_violation_is_a_clear_error():
    """safe_gate with g below the lower bound: a ValueError naming the bound (CPU; on CUDA an async device check)."""
    if CUDA:
        pytest.skip("on CUDA the check is asynchronous (torch._assert_async) and would poison the CUDA context")
    q, k, v, g, beta, _ = make_inputs(1, 20, 1, 1, 32, 32, torch.float32)
    with pytest.raises(ValueError, match=r"safe_gate=True needs every g >= -5.*min\(g\)=-6"):
        chunk_kda(q, k, v, torch.full_like(g, -6.0), beta, safe_gate=True, lower_bound=-5.0)


def test_chunk_in_kernel_flags_forward_and_gate_gradients():
    B, T, H, HV, D = 1, 20, 1, 1, 32
    q, k, v, _, _, h0 = make_inputs(B, T, H, HV, D, D, torch.float32)
    q, k = torch.rand_like(q), torch.rand_like(k)
    z, b_logit = torch.randn(B, T, HV, D, device=DEV), torch.randn(B, T, HV, device=DEV)
    A_log, dt_bias = torch.randn(HV, device=DEV), torch.randn(HV * D, device=DEV)

    def run(fn, xs):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        o, s = fn(*leaves)
        return [o, s, *torch.autograd.grad(o.sum() + s.sum(), leaves)]

    def ref_fn(q, k, v, z, b, A, dtb):
        g = naive_kda_lowerbound_gate(z, A, dtb, -5.0)
        return naive_recurrent_kda(l2norm(q), l2norm(k), v, g, b.sigmoid(), initial_state=h0.double().cpu(),
                                   output_final_state=True)

    def out_fn(q, k, v, z, b, A, dtb):
        return chunk_kda(q, k, v, z, b, A_log=A, dt_bias=dtb, initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         safe_gate=True, lower_bound=-5.0)

    xs = [q, k, v, z, b_logit, A_log, dt_bias]
    ref = run(ref_fn, [x.double().cpu() for x in xs])
    out = run(out_fn, xs)
    names = ["o", "ht", "dq", "dk", "dv", "dz", "dbeta_logit", "dA_log", "d_dt_bias"]
    ratios = [0.005, 0.005, 0.008, 0.008, 0.008, 0.02, 0.02, 0.003, 0.008]
    for name, r, x, ratio in zip(names, ref, out, ratios, strict=True):
        assert_close(name, r, x, ratio)


def test_chunk_varlen_and_intermediate_states():
    cu = [0, 15, 80]
    q, k, v, g, beta, h0 = make_inputs(1, 80, 1, 1, 32, 32, torch.float32, N=2)
    ro, rs = naive64(q, k, v, g, beta, h0, cu)
    o, s, h = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, safe_gate=True,
                        cu_seqlens=torch.tensor(cu, device=DEV), return_intermediate_states=True)
    assert_close("o", ro, o, 0.005)
    assert_close("ht", rs, s, 0.005)
    # chunks: sequence 0 -> [0, 15); sequence 1 -> [15, 79), [79, 80): h = state entering each (fp32)
    assert h.shape == (1, 3, 1, 32, 32) and h.dtype == torch.float32
    assert_close("h[0]", h0[0], h[0, 0], 1e-5)
    assert_close("h[1]", h0[1], h[0, 1], 1e-5)
    _, s_f64 = naive64(q[:, 15:79], k[:, 15:79], v[:, 15:79], g[:, 15:79], beta[:, 15:79], h0[1:2])
    assert_close("h[2]", s_f64[0], h[0, 2], 1e-5)


def test_chunk_extreme_gates_exact_path():
    """Unbounded gate with g = -1000 entries: the exact pairwise diagonal path must stay finite and correct."""
    q, k, v, g, beta, h0 = make_inputs(1, 24, 1, 1, 32, 32, torch.float32)
    g = g.clone()
    g[0, 3, 0, :7] = -1000.0
    g[0, 17, 0, 5:] = -1000.0
    ro, rs = naive64(q, k, v, g, beta, h0)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close("o", ro, o, 0.005)
    assert_close("ht", rs, s, 0.005)


def test_chunk_no_dependence_on_later_tokens():
    """kda.md 6.3: changing tokens after position t leaves outputs <= t unchanged (fixed anchor, masked dots)."""
    t = 21
    q, k, v, g, beta, h0 = make_inputs(1, 40, 1, 1, 32, 32, torch.float32)
    o1, _ = chunk_kda(q, k, v, g, beta, initial_state=h0, safe_gate=True)
    g2 = g.clone()
    g2[:, t + 1 :] = -5.0 * torch.rand_like(g2[:, t + 1 :])
    v2 = v.clone()
    v2[:, t + 1 :] = 100.0
    o2, _ = chunk_kda(q, k, v2, g2, beta, initial_state=h0, safe_gate=True)
    assert_close("prefix", o1[:, : t + 1], o2[:, : t + 1], 1e-6)
    assert not torch.allclose(o1[:, t + 1 :], o2[:, t + 1 :])


def test_recurrent_decode_continues_chunk_prefill():
    q, k, v, g, beta, h0 = make_inputs(1, 24, 1, 1, 32, 32, torch.float32)
    ro, rs = naive64(q, k, v, g, beta, h0)
    o, s = chunk_kda(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], initial_state=h0,
                     output_final_state=True, safe_gate=True)
    outs = [o]
    for t in range(20, 24):
        o_t, s = fused_recurrent_kda(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                                     beta[:, t : t + 1], initial_state=s, output_final_state=True)
        outs.append(o_t)
    assert_close("o", ro, torch.cat(outs, 1), 0.005)
    assert_close("ht", rs, s, 0.005)


# ---------------------------------------------------------------------------------------------- dispatch


def test_backend_selection(monkeypatch):
    assert dispatch.parse_backend("triton") == "triton"
    assert set(dispatch.TRITON_OPS) == {"chunk_kda", "fused_recurrent_kda", "c2_glu", "paged_mla_decode",
                                        "quant_grouped_mm", "quant_linear", "attn_res_mix", "causal_conv1d",
                                        "causal_conv1d_multi", "gated_rms_norm", "causal_max_logit", "rms_norm",
                                        "softmax_rows", "c2_glu_packed", "moe_unpermute"}
    if not CUDA:
        assert dispatch.parse_backend(None) == "torch"  # default: torch without a GPU, even when triton imports
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(dispatch.KernelBackendError, match="TRITON_INTERPRET=1.*K3_KERNELS=torch"):
            dispatch.parse_backend("triton")
    else:
        assert dispatch.parse_backend(None) == "triton"


def test_varlen_chunk_layout_is_reused_only_for_the_same_unmodified_tensor():
    """chunk_layout reads cu_seqlens on the host once per tensor object (every layer of a step passes the same
    one); an in-place change or another tensor with other values recomputes it."""

    cu = torch.tensor([0, 5, 70, 70, 130])
    first = common_mod.chunk_layout(1, 130, 64, cu, "cpu")
    assert common_mod.chunk_layout(1, 130, 64, cu, "cpu") is first
    assert first[:3] == (4, 0, 1 + 2 + 0 + 1)
    cu[1] = 40  # in place: a new _version
    again = common_mod.chunk_layout(1, 130, 64, cu, "cpu")
    assert again is not first and again[2] == 1 + 1 + 0 + 1
    other = torch.tensor([0, 64, 70, 70, 130])
    assert common_mod.chunk_layout(1, 130, 64, other, "cpu")[2] == 1 + 1 + 0 + 1
    assert common_mod.chunk_layout(1, 130, 32, cu, "cpu")[2] == 2 + 1 + 0 + 2  # another chunk size


PREC_CASES = [(prec, c) for prec in ("tf32", "bf16") for c in GRAD_CASES]


@pytest.mark.parametrize("prec,B,T,H,HV,D,BT,safe,h0,final", [(p, *c) for p, c in PREC_CASES],
                         ids=[f"{p}-{case_id(*c[:5])}-BT{c[5]}-{'safe' if c[6] else 'exact'}" for p, c in PREC_CASES])
def test_chunk_gradients_reduced_precision_dots(prec, B, T, H, HV, D, BT, safe, h0, final, monkeypatch):
    """bf16 inputs with the backward's inter-chunk dots (scan, inter kernel, the intra kernel's off-diagonal blocks)
    in tf32 or bf16 (launch.LAUNCH[...]["PREC"]): the gradients still meet the bf16 thresholds against
    the recurrence (kda.md 6.2; the intra kernel's diagonal blocks keep bf16x3). On the CPU, whose interpreter
    ignores tf32 and cannot run bf16 inputs (its bf16 tl.dot is broken), the bf16 case runs fp32 inputs with those
    dots' operands rounded to bf16 (common._dot's emulation): the rounding, checked at the bf16 thresholds."""

    dtype = torch.bfloat16
    if not CUDA:
        if prec == "tf32":
            pytest.skip("tf32 is a GPU setting: the interpreter multiplies in fp32")
        dtype = torch.float32
        monkeypatch.setattr(bwd_mod, "dot_prec", lambda name, dt: "bf16_emulated")
    for name in ("bwd_scan", "bwd_inter", "bwd_intra"):
        monkeypatch.setitem(launch_mod.LAUNCH[name], "PREC", prec)
    q, k, v, g, beta, s0 = make_inputs(B, T, H, HV, D, D, dtype)
    ref, out = grads_vs_naive(q, k, v, g, beta, s0 if h0 else None, BT=BT, safe=safe, final=final)
    for name, r, x, ratio in zip(GRAD_NAMES, ref, out, GRAD_RATIOS, strict=False):
        assert_close(name, r, x, ratio_for(torch.bfloat16, ratio))


def test_backward_dot_precision_setting(monkeypatch, kernel_env):
    """fp32 inputs run tf32x3 dots unless K3_KDA_FP32_DOTS says otherwise; bf16/fp16 take LAUNCH[...]["PREC"] for
    the scan and inter kernels and the intra kernel's off-diagonal dots (its diagonal keeps bf16x3, kda.md 3.3); an
    unknown precision is a clear error; the interpreter runs what it can (bf16x3 as IEEE, bf16 emulated)."""

    kernel_env(K3_KDA_FP32_DOTS=None)
    assert launch_mod.dot_prec("bwd_inter", torch.float32) == "tf32x3"
    assert launch_mod.dot_prec("bwd_intra", torch.bfloat16) == launch_mod.interpreted(
        launch_mod.LAUNCH["bwd_intra"]["PREC"])
    monkeypatch.setitem(launch_mod.LAUNCH["bwd_scan"], "PREC", "bf16")
    assert launch_mod.dot_prec("bwd_scan", torch.bfloat16) == ("bf16_emulated" if triton_interpreter() else "bf16")
    assert launch_mod.interpreted("bf16x3") == ("ieee" if triton_interpreter() else "bf16x3")
    monkeypatch.setitem(launch_mod.LAUNCH["bwd_inter"], "PREC", "tf32")
    assert launch_mod.dot_prec("bwd_inter", torch.float16) == "tf32"
    assert launch_mod.dot_prec("bwd_scan", torch.bfloat16) == launch_mod.interpreted(
        launch_mod.LAUNCH["bwd_scan"]["PREC"])
    monkeypatch.setitem(launch_mod.LAUNCH["bwd_scan"], "PREC", "fp8")
    with pytest.raises(ValueError, match=r"LAUNCH\['bwd_scan'\]\['PREC'\] = 'fp8'; use one of"):
        launch_mod.dot_prec("bwd_scan", torch.bfloat16)


@pytest.mark.parametrize("setting", ["tf32x3", "tf32", "ieee", ""])
def test_fp32_dot_precision_setting(setting, monkeypatch, kernel_env):
    """K3_KDA_FP32_DOTS picks the dot precision every chunk kernel gets for fp32 inputs, forward and backward (unset or
    empty: tf32x3); the outputs and gradients stay within the fp32 ratios (on the CPU the interpreter multiplies in fp32
    whatever the setting: there this checks what reaches the kernels). bf16 inputs are unaffected."""

    kernel_env(K3_KDA_FP32_DOTS=setting)
    want = setting or "tf32x3"
    seen = []

    def spy(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, type("Spy", (), {"__name__": name, "__getitem__": lambda _, grid: (
            lambda *a, **kw: (seen.append((name, kw.get("PREC"), kw.get("OFF"))), real[grid](*a, **kw))[1])})())

    for module, name in ((fwd_mod, "_intra_sub_kernel"), (fwd_mod, "_solve_kernel"), (fwd_mod, "_wu_kernel"),
                         (bwd_mod, "_bwd_inter_kernel"), (bwd_mod, "_bwd_intra_kernel")):
        spy(module, name)
    q, k, v, g, beta, h0 = make_inputs(1, 40, 1, 2, 32, 32, torch.float32)
    ref, out = grads_vs_naive(q, k, v, g, beta, h0)
    for name, r, x, ratio in zip(GRAD_NAMES, ref, out, GRAD_RATIOS, strict=True):
        assert_close(name, r, x, ratio)
    assert {n for n, *_ in seen} == {"_intra_sub_kernel", "_solve_kernel", "_wu_kernel", "_bwd_inter_kernel",
                                     "_bwd_intra_kernel"}
    for name, prec, off in seen:  # the backward intra kernel: PREC its diagonal dots, OFF the others
        assert prec == want and off in (None, want), (name, prec, off)
    assert launch_mod.dot_prec("bwd_scan", torch.float32) == want
    assert launch_mod.dot_prec("bwd_scan", torch.bfloat16) == launch_mod.interpreted(
        launch_mod.LAUNCH["bwd_scan"]["PREC"])  # bf16 inputs: LAUNCH's, whatever the setting


def test_fp32_dot_precision_rejects_unknown_values(monkeypatch, kernel_env):
    kernel_env(K3_KDA_FP32_DOTS="fp8")
    q, k, v, g, beta, h0 = make_inputs(1, 20, 1, 1, 32, 32, torch.float32)
    with pytest.raises(ValueError, match=r"K3_KDA_FP32_DOTS must be one of \('ieee', 'tf32x3', 'tf32'\), got 'fp8'"):
        chunk_kda(q, k, v, g, beta, initial_state=h0)


def test_v_blocks_keep_the_wu_kernel_off_narrow_blocks(monkeypatch):
    """LAUNCH's BV, capped at next_pow2(V) and at 32 for K > 128; the w/u kernel runs blocks of at least
    LAUNCH["wu"]["MIN_BV"] (64) whatever K and V (its V-block 16 and 32 launches hit an illegal memory access or
    computed wrong outputs on the H200, at V = 128 and at V = 32: launch.v_block)."""

    for name in ("wu", "scan"):
        monkeypatch.setitem(launch_mod.LAUNCH[name], "BV", 16)
    assert launch_mod.v_block("scan", 128, 128) == 16
    assert launch_mod.v_block("wu", 128, 128) == 64
    assert launch_mod.v_block("wu", 32, 32) == 64  # V = 32: one block, half of it masked
    assert launch_mod.v_block("wu", 16, 16) == 64
    monkeypatch.setitem(launch_mod.LAUNCH["wu"], "MIN_BV", 32)
    assert launch_mod.v_block("wu", 32, 32) == 32
    monkeypatch.setitem(launch_mod.LAUNCH["wu"], "MIN_BV", 64)
    monkeypatch.setitem(launch_mod.LAUNCH["wu"], "BV", 64)
    assert launch_mod.v_block("wu", 128, 128) == 64
    assert launch_mod.v_block("wu", 60, 64) == 64
    assert launch_mod.v_block("wu", 128, 256) == 64  # K > 128: the other kernels take 32
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "BV", 64)
    assert launch_mod.v_block("scan", 128, 256) == 32


def test_wu_launch_caps_the_forward_at_k_block_128(monkeypatch, launch_kwargs):
    """wu_launch: the forward's w/u launch (no qg) at K block 128 takes FWD_BV and the register cap FWD_MAXNREG; the
    backward's recompute, K <= 64, or a cap of 0 keep v_block and launch_opts. A LAUNCH entry's own "maxnreg" (0 by
    default) reaches its kernel's options (register_cap), forward and backward. And the forward passes wu_launch's
    block and cap to the kernel (a launch that records its keywords; the interpreter ignores maxnreg)."""

    plain = launch_mod.launch_opts("wu")
    assert "maxnreg" not in plain
    monkeypatch.setitem(launch_mod.LAUNCH["wu"], "FWD_MAXNREG", 168)
    monkeypatch.setitem(launch_mod.LAUNCH["wu"], "FWD_BV", 128)
    assert launch_mod.wu_launch(128, 128, True) == (128, {**plain, "maxnreg": 168})
    assert launch_mod.wu_launch(60, 128, True) == (64, {**plain, "maxnreg": 168})  # at most next_pow2(V)
    assert launch_mod.wu_launch(128, 256, True)[1]["maxnreg"] == 168  # K = 256: two K blocks of 128
    assert launch_mod.wu_launch(128, 128, False) == (launch_mod.v_block("wu", 128, 128), plain)  # the recompute (qg)
    assert launch_mod.wu_launch(64, 64, True) == (64, plain)  # K block 64
    monkeypatch.setitem(launch_mod.LAUNCH["wu"], "FWD_MAXNREG", 0)
    assert launch_mod.wu_launch(128, 128, True) == (launch_mod.v_block("wu", 128, 128), plain)
    monkeypatch.setitem(launch_mod.LAUNCH["intra"], "maxnreg", 200)
    monkeypatch.setitem(launch_mod.LAUNCH["bwd_intra"], "maxnreg", 192)
    assert launch_mod.intra_opts(128)["maxnreg"] == 200 and launch_mod.intra_opts(32)["maxnreg"] == 200
    assert launch_mod.intra_launch(128)[1]["maxnreg"] == 192
    monkeypatch.setitem(launch_mod.LAUNCH["intra"], "maxnreg", 0)
    assert "maxnreg" not in launch_mod.intra_opts(128)

    monkeypatch.setitem(launch_mod.LAUNCH["wu"], "FWD_MAXNREG", 168)
    seen = launch_kwargs(fwd_mod, "_wu_kernel", ("BV", "maxnreg", "STORE_QG"))
    q, k, v, g, beta, h0 = make_inputs(1, 20, 1, 1, 128, 128, torch.float32)
    o, _ = chunk_kda(q, k, v, g, beta, initial_state=h0)
    ro, _ = naive_recurrent_kda(*(x.double().cpu() for x in (q, k, v, g, beta)), initial_state=h0.double().cpu())
    assert seen == [(128, 168, False)]
    assert_close("o", ro, o, 0.005)


def test_solve_register_cap_only_in_a_training_forward(monkeypatch, launch_kwargs):
    """solve_opts: the register cap TRAIN_MAXNREG goes to the training solve (from Akk and beta) only; the inference
    solve (from L) takes launch_opts. chunk_fwd_pipeline launches each accordingly (a spy on the launch keywords)."""

    monkeypatch.setitem(launch_mod.LAUNCH["solve"], "TRAIN_MAXNREG", 112)
    assert launch_mod.solve_opts(True) == {**launch_mod.launch_opts("solve"), "maxnreg": 112}
    assert launch_mod.solve_opts(False) == launch_mod.launch_opts("solve")
    assert "maxnreg" not in launch_mod.solve_opts(False)
    seen = launch_kwargs(fwd_mod, "_solve_kernel", ("BETA", "maxnreg"))
    q, k, v, g, beta, h0 = make_inputs(1, 20, 1, 1, 32, 32, torch.float32)
    kw = {"scale": 32**-0.5, "safe_shift": None, "chunk_size": 64, "cu_seqlens": None, "h_fp32": False}
    for store_akk in (True, False):
        fwd_mod.chunk_fwd_pipeline(q, k, v, g, beta, h0, store_akk=store_akk, **kw)
    assert seen == [(True, 112), (False, None)]
    monkeypatch.setitem(launch_mod.LAUNCH["solve"], "TRAIN_MAXNREG", 0)
    assert "maxnreg" not in launch_mod.solve_opts(True)


@pytest.mark.parametrize("D,split", [(100, 64), (32, 16)], ids=["K100-halves64", "K32-halves16"])
def test_forward_in_k_halves_matches_naive(D, split, monkeypatch, launch_kwargs):
    """An inference forward with fp16 L and the intra kernel in K halves (LAUNCH["intra"]["KSPLIT_FROM"]; K = 100:
    the second half masked to 36 columns) against the float64 recurrence, and against the unsplit forward, with a
    partial chunk and an initial state; the launch spy sees two K halves, the solve adding two parts of L, and the
    output's reader two of Aqk: the scan (output fused) or, with the states returned in fp32, the output kernel."""

    q, k, v, g, beta, h0 = make_inputs(1, 70, 1, 2, D, 32, torch.float32)
    g = g.clamp_min(-5.0)
    kw = {"scale": D**-0.5, "safe_shift": 7.5 * 5.0 / 2, "chunk_size": 64, "cu_seqlens": None, "h_fp32": False,
          "l_fp16": True}
    ro, rs = naive64(q, k, v, g, beta, h0)
    whole = fwd_mod.chunk_fwd_pipeline(q, k, v, g, beta, h0, **kw)
    monkeypatch.setitem(launch_mod.LAUNCH["intra"], "KSPLIT_FROM", split)
    intra = launch_kwargs(fwd_mod, "_intra_sub_kernel", ("BK", "KSPLIT"))
    solve = launch_kwargs(fwd_mod, "_solve_kernel", ("PARTS",))
    scan = launch_kwargs(fwd_mod, "_scan_kernel", ("OUTPUT", "AQK_PARTS"))
    output = launch_kwargs(fwd_mod, "_output_kernel", ("AQK_PARTS",))
    halves = fwd_mod.chunk_fwd_pipeline(q, k, v, g, beta, h0, **kw)
    states = fwd_mod.chunk_fwd_pipeline(q, k, v, g, beta, h0, **{**kw, "h_fp32": True})  # the output kernel's path
    assert intra == [(split, 2)] * 2 and solve == [(2,)] * 2
    assert scan == [(True, 2), (False, 2)] and output == [(2,)]
    for name, r in (("whole", whole), ("K halves", halves), ("K halves, output kernel", states)):
        assert_close(f"o ({name})", ro, r["o"], 0.005)
        assert_close(f"ht ({name})", rs, r["ht"], 0.005)
    assert_close("o (K halves vs whole)", whole["o"].double(), halves["o"], 1e-3)
    assert_close("o (output kernel vs fused)", halves["o"].double(), states["o"], 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, *([torch.bfloat16] if CUDA else [])], ids=str)
def test_inference_forward_scales_q_rows_by_its_rstd(dtype, monkeypatch, launch_kwargs):
    """An inference forward (no gradients) with the q / k L2 norm: the norm pass stores q's rstd alone (no normalised
    copy) and the intra kernel scales q's rows by it (LAUNCH["intra"]["Q_RSTD"]); with the states returned (the
    output kernel's path, which reads q itself) q is normalised before the kernels instead. Raw rows of norm far from
    1, a partial chunk, an initial state, K = 64: outputs and final states as the float64 recurrence on the normalised
    q, k, and as with Q_RSTD off (q normalised by the pass). Then in K halves of 32 (V = 32: the case the H200 got
    wrong in bf16 without the w/u kernel's V block floor, launch.v_block)."""

    monkeypatch.setitem(launch_mod.LAUNCH["intra"], "Q_RSTD", True)
    monkeypatch.setitem(launch_mod.LAUNCH["intra"], "KSPLIT_FROM", 0)
    q, k, v, g, beta, h0, ro, rs = raw_qk_inputs(64, 32, dtype)
    intra = launch_kwargs(fwd_mod, "_intra_sub_kernel", ("Q_RSTD",))
    norm = launch_kwargs(norm_mod, "_l2norm_fwd_kernel", ("STORE_Y",))
    kw = {"initial_state": h0, "output_final_state": True, "use_qk_l2norm_in_kernel": True, "safe_gate": True,
          "lower_bound": -5.0}
    with torch.no_grad():
        rows = chunk_kda(q, k, v, g, beta, **kw)
        states = chunk_kda(q, k, v, g, beta, return_intermediate_states=True, **kw)[:2]
        monkeypatch.setitem(launch_mod.LAUNCH["intra"], "Q_RSTD", False)
        normed = chunk_kda(q, k, v, g, beta, **kw)
    assert intra == [(True,), (False,), (False,)]
    assert norm == [(False,), (True,)] * 2 + [(True,), (True,)]
    tol = 0.005 if dtype == torch.float32 else 0.02
    for name, (o, s) in (("q rows scaled", rows), ("output kernel", states), ("q normalised", normed)):
        assert_close(f"o ({name})", ro, o, tol)
        assert_close(f"ht ({name})", rs, s, tol)
    assert_close("o (q rows scaled vs normalised)", normed[0].double(), rows[0], 1e-3 if dtype == torch.float32
                 else 0.01)
    # in K halves: the pipeline called with fp16 L and q's rstd, as chunk_kda calls it for bf16 inputs

    monkeypatch.setitem(launch_mod.LAUNCH["intra"], "KSPLIT_FROM", 64)
    split = launch_kwargs(fwd_mod, "_intra_sub_kernel", ("KSPLIT", "Q_RSTD"))
    (_, rq), (kn, _) = norm_mod.l2norm_fwd(q, store_y=False), norm_mod.l2norm_fwd(k)
    r = fwd_mod.chunk_fwd_pipeline(q, kn, v, g, beta, h0.float(), scale=64**-0.5, safe_shift=7.5 * 5.0 / 2,
                                   chunk_size=64, cu_seqlens=None, h_fp32=False, l_fp16=True, q_rstd=rq)
    assert split == [(2, True)]
    assert_close("o (K halves, q's rows by rstd)", ro, r["o"], tol)
    assert_close("ht (K halves, q's rows by rstd)", rs, r["ht"], tol)


@pytest.mark.parametrize("D", [64, 128], ids=["K64-halves32", "K128-halves64"])
def test_half_inference_forward_in_k_halves(D, monkeypatch, launch_kwargs, bounds_check):
    """chunk_kda on fp16 inputs with the q / k L2 norm and no gradients, in K halves (LAUNCH["intra"]["KSPLIT_FROM"]):
    fp16 L and Aqk as two fp16 partial sums each, q's rows scaled by its rstd, the fused scan adding Aqk's parts; a
    partial chunk and an initial state. fp16: under the interpreter its dots are the GPU's formats (bf16 ones need
    conftest's bf16_dots). Outputs and final states as the float64 recurrence on the normalised q, k, and as the
    unsplit forward; no load or store outside the launches' tensors (conftest's bounds_check)."""

    q, k, v, g, beta, h0, ro, rs = raw_qk_inputs(D, 32, torch.float16)
    intra = launch_kwargs(fwd_mod, "_intra_sub_kernel", ("KSPLIT", "Q_RSTD"))
    scan = launch_kwargs(fwd_mod, "_scan_kernel", ("AQK_PARTS",))
    kw = {"initial_state": h0, "output_final_state": True, "use_qk_l2norm_in_kernel": True, "safe_gate": True,
          "lower_bound": -5.0}
    with torch.no_grad():
        monkeypatch.setitem(launch_mod.LAUNCH["intra"], "KSPLIT_FROM", 0)
        whole = chunk_kda(q, k, v, g, beta, **kw)
        monkeypatch.setitem(launch_mod.LAUNCH["intra"], "KSPLIT_FROM", D)
        halves = chunk_kda(q, k, v, g, beta, **kw)
    assert intra == [(1, True), (2, True)] and scan == [(1,), (2,)]
    assert bounds_check == []
    for name, (o, s) in (("whole", whole), ("K halves", halves)):
        assert_close(f"o ({name})", ro, o, 0.005)
        assert_close(f"ht ({name})", rs, s, 0.005)
    assert_close("o (K halves vs whole)", whole[0].double(), halves[0], 0.005)


@pytest.mark.parametrize("D,V,split", [(64, 32, 0), (64, 32, 64), (128, 128, 128)],
                         ids=["K64-V32-whole", "K64-V32-halves32", "K128-V128-halves64"])
def test_bf16_inference_forward_interpreted(D, V, split, monkeypatch, launch_kwargs, bf16_dots, bounds_check):
    """chunk_kda on bf16 inputs with the q / k L2 norm and no gradients, whole and in K halves, q's rows scaled by
    its rstd; under the interpreter with bf16 dots as a GPU computes them (conftest's bf16_dots). The case that fails
    on the H200 at a w/u V block of 32 (K = 64, V = 32, T = 70, whole or in halves: a compiled-code fault, hence
    launch.v_block's floor of 64) is right in bf16 arithmetic here, and this test on a GPU checks the compiled one.
    Outputs and final states against the float64 recurrence on the normalised q, k (0.03: the interpreter's fp32 ->
    bf16 casts truncate; the GPU tests' bf16 bound is 0.02), and no load or store outside the launches' tensors
    (conftest's bounds_check, interpreter only)."""

    monkeypatch.setitem(launch_mod.LAUNCH["intra"], "KSPLIT_FROM", split)
    q, k, v, g, beta, h0, ro, rs = raw_qk_inputs(D, V, torch.bfloat16)
    intra = launch_kwargs(fwd_mod, "_intra_sub_kernel", ("KSPLIT", "Q_RSTD"))
    with torch.no_grad():
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         safe_gate=True, lower_bound=-5.0)
    assert intra == [(2 if split else 1, True)]
    assert bounds_check == []
    assert_close("o", ro, o, 0.03)
    assert_close("ht", rs, s, 0.03)


def test_l_in_fp16_only_for_normalised_half_inputs(monkeypatch):
    """l_in_fp16: L in fp16 for bf16 / fp16 inputs whose q and k the forward L2-normalises (|L| <= 1), never for fp32
    inputs or raw keys, and not with LAUNCH["intra"]["L_FP16"] off; chunk_kda passes that choice to
    chunk_fwd_pipeline (a spy that stops the call there)."""

    class Stop(Exception):
        pass

    seen = []

    def spy(*args, **kw):
        seen.append(kw["l_fp16"])
        raise Stop

    monkeypatch.setattr(fwd_mod, "chunk_fwd_pipeline", spy)
    for dtype, norm in itertools.product((torch.bfloat16, torch.float16, torch.float32), (True, False)):
        assert launch_mod.l_in_fp16(norm, dtype) == (norm and dtype != torch.float32)
        q, k, v, g, beta, _ = make_inputs(1, 20, 1, 1, 32, 32, dtype)
        with pytest.raises(Stop):
            chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=norm)
        assert seen.pop() == (norm and dtype != torch.float32)
    monkeypatch.setitem(launch_mod.LAUNCH["intra"], "L_FP16", False)
    assert not launch_mod.l_in_fp16(True, torch.bfloat16)


@pytest.mark.skipif(not CUDA, reason="torch.compile traces the Triton launches only as GPU (JIT) kernels")
def test_chunk_kda_under_torch_compile_matches_eager(monkeypatch):
    """chunk_kda inside torch.compile (as `k3 pretrain` with train.compile): dynamo traces the autograd Function and its
    Triton launches, including the launch options beyond num_warps / num_stages (the w/u kernel's and the training
    solve's register caps, `maxnreg`). Output, final state and every gradient equal the eager call's (bf16, K = 128,
    safe gate, l2norm in kernel: the launches with caps)."""
    # inductor fails on the conftest's NaN-poisoned allocations (test_decode_compile says how): the real torch.empty
    monkeypatch.setattr(torch, "empty", getattr(torch.empty, "real", torch.empty))
    torch._dynamo.reset()
    q, k, v, g, beta, h0 = make_inputs(2, 130, 2, 2, 128, 128, torch.bfloat16)
    g = g.clamp_min(-5.0)

    def step(q, k, v, g, beta, h0):
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, safe_gate=True,
                         lower_bound=-5.0, use_qk_l2norm_in_kernel=True)
        return (o.float() ** 2).sum() + s.sum()

    grads = []
    for fn in (step, torch.compile(step)):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        loss = fn(*leaves)
        grads.append([loss.detach(), *torch.autograd.grad(loss, leaves)])
    for name, a, b in zip(("loss", "dq", "dk", "dv", "dg", "dbeta", "dh0"), *grads, strict=True):
        assert_close(f"{name} (compiled vs eager)", a.double(), b.double(), 1e-3)


def test_scan_v_block_splits_when_few_sequences():
    """The state scans halve their V block (down to 16) while N * HV * V / BV programs, halved, stay below the
    multiprocessor count."""

    assert launch_mod.scan_v_block(64, 128, 16, 132) == 16  # (1, T, 16, 128): 32 programs at BV 64 -> 128 at 16
    assert launch_mod.scan_v_block(64, 128, 32, 132) == 32  # (2, T, 16, 128): 64 -> 128 (256 at 16 would not be fewer)
    assert launch_mod.scan_v_block(64, 128, 33, 132) == 64  # 66 -> 132 would not be fewer
    assert launch_mod.scan_v_block(64, 128, 1, 132) == 16  # never below 16 (tl.dot)
    assert launch_mod.scan_v_block(64, 128, 128, 132) == 64  # (8, T, 16, 128): 256 programs already
    assert launch_mod.scan_v_block(64, 64, 512, 132) == 64
    assert launch_mod.scan_v_block(64, 128, 1, 0) == 64  # no GPU (the interpreter): LAUNCH's


def test_bwd_scan_launch():
    """The reverse scan's V block (LAUNCH["bwd_scan"]["BV"] = 128, halved as the forward scans' are) and launch: a
    block of 128 at 8 warps / 2 stages (WIDE_*), K <= 64 at SMALL_K_STAGES, K > 128 (two K halves) at most 64."""

    entry, plain = launch_mod.LAUNCH["bwd_scan"], launch_mod.launch_opts("bwd_scan")
    wide = {"num_warps": entry["WIDE_WARPS"], "num_stages": entry["WIDE_STAGES"]}
    assert launch_mod.bwd_scan_launch(128, 128, 128, 132) == (128, wide)  # (8, T, 16, 128): 128 programs
    assert launch_mod.bwd_scan_launch(128, 128, 64, 132)[0] == 64  # (4, T, 16, 128): 128 programs at 64, not 256
    assert launch_mod.bwd_scan_launch(128, 128, 32, 132) == (32, plain)  # (2, T, 16, 128): the plain launch
    small = launch_mod.bwd_scan_launch(64, 64, 512, 132)  # (16, T, 32, 64)
    assert small == (64, {**plain, "num_stages": entry["SMALL_K_STAGES"]})
    assert launch_mod.bwd_scan_launch(256, 256, 1, 0) == (64, plain)  # K halves: 64 at most


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_chunk_gradients_with_the_wide_reverse_scan(dtype, monkeypatch, launch_spy):
    """The reverse scan at V block 128, one program per sequence and head (8 warps, 2 stages; on a GPU the scans
    halve their block for so few sequences, so the multiprocessor count is hidden here): gradients as the
    recurrence's. fp32 tiles do not fit 2 stages on an H200: launch_fitting relaunches that one at 1 stage."""

    monkeypatch.setattr(bwd_mod, "device_sms", lambda dev: 0)
    grids = launch_spy(bwd_mod, "_bwd_scan_kernel")
    q, k, v, g, beta, h0 = make_inputs(1, 70, 1, 2, 128, 128, dtype)
    ref, out = grads_vs_naive(q, k, v, g, beta, h0)
    assert grids and {tuple(x) for x in grids} == {(1, 1, 2)}, "one V block of 128"
    for name, r, x, ratio in zip(GRAD_NAMES, ref, out, GRAD_RATIOS, strict=True):
        assert_close(name, r, x, ratio_for(dtype, ratio))

QK_NORM_CASES = [  # (B, T, H, HV, D, chunk_size, safe_gate, cu_seqlens, K3_KDA_BWD)
    (2, 70, 1, 2, 32, 64, True, None, "triton"),  # GVA, a partial chunk, the whole intra walk
    (1, 45, 1, 1, 60, 32, False, None, "triton"),  # exact diagonal path, K padded (60 -> 64)
    (1, 80, 2, 2, 32, 64, True, [0, 15, 15, 80], "triton"),  # varlen with an empty sequence
    (1, 40, 1, 2, 32, 16, True, None, "torch"),  # the PyTorch backward from raw q, k
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("B,T,H,HV,D,BT,safe,cu,bwd", QK_NORM_CASES,
                         ids=[f"{case_id(*c[:5])}-BT{c[5]}-{'safe' if c[6] else 'exact'}{'-varlen' if c[7] else ''}-"
                              f"{c[8]}" for c in QK_NORM_CASES])
def test_chunk_qk_l2norm_in_kernel_gradients(B, T, H, HV, D, BT, safe, cu, bwd, dtype, monkeypatch, kernel_env):
    """use_qk_l2norm_in_kernel=True: raw q, k (rows of norm far from 1) through the in-kernel L2 norm (its Triton pass
    each way) and the chunk kernels, against the float64 recurrence on l2norm(q), l2norm(k): outputs, final state and
    the gradients of the raw q, k (through the norm) and of v, g, beta, h0; also with the PyTorch backward."""
    kernel_env(K3_KDA_BWD=bwd)
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, D, D, dtype, N=None if cu is None else len(cu) - 1)
    q, k = 3 * torch.rand_like(q) - 1, 2 * torch.rand_like(k)  # raw rows of norm far from 1
    g = g.clamp_min(-5.0) if safe else g
    ref, out = grads_vs_naive(q, k, v, g, beta, h0, BT=BT, safe=safe, cu=cu, qk_norm=True)
    for name, r, x, ratio in zip(GRAD_NAMES, ref, out, VARLEN_RATIOS if cu else GRAD_RATIOS, strict=True):
        assert_close(name, r, x, ratio_for(dtype, ratio))


@pytest.mark.parametrize("D", [32, 60], ids=["K32", "K60"])
@pytest.mark.parametrize("intra_bk,q_out", [(64, False), (16, False), (16, True)],
                         ids=["fused", "k-blocks", "k-blocks-q-from-output"])
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_qk_norm_backward_fused_into_the_intra_kernel(intra_bk, q_out, D, varlen, monkeypatch, launch_spy, kernel_env):
    """The L2 norm's backward runs as the backward intra kernel's epilogue (NORM) when one of its K blocks holds the
    head and q / k heads are not shared; with the head in K blocks (K block 16 at K = 32 and 60, the last block
    partial at 60) it runs its own pass, from the normalized q, k the Function keeps, or with Q_NORM_OUT q's runs in
    the intra kernel all the same (its row sum from the output and its gradient) and k's alone in the pass. All:
    gradients of the raw q, k as the recurrence's (a partial chunk; varlen with an empty sequence)."""

    kernel_env(K3_KDA_BWD="triton")
    monkeypatch.setitem(launch_mod.LAUNCH["bwd_intra"], "BK", intra_bk)
    monkeypatch.setitem(launch_mod.LAUNCH["bwd_intra"], "Q_NORM_OUT", q_out)
    fwd_grids = launch_spy(norm_mod, "_l2norm_fwd_kernel")
    bwd_grids = launch_spy(norm_mod, "_l2norm_bwd_kernel")
    cu = [0, 20, 20, 45] if varlen else None
    q, k, v, g, beta, h0 = make_inputs(1, 45, 1, 1, D, 32, torch.float32, N=3 if varlen else None)
    q, k = 3 * torch.rand_like(q) - 1, 2 * torch.rand_like(k)  # raw rows of norm far from 1
    ref, out = grads_vs_naive(q, k, v, g.clamp_min(-5.0), beta, h0, cu=cu, qk_norm=True)
    for name, r, x, ratio in zip(GRAD_NAMES, ref, out, VARLEN_RATIOS if varlen else GRAD_RATIOS, strict=True):
        assert_close(name, r, x, ratio)
    assert len(fwd_grids) == 2 and len(bwd_grids) == (0 if intra_bk >= D else 1 if q_out else 2)


@pytest.mark.parametrize("D", [32, 60], ids=["K32", "K60"])
def test_chunk_gradients_with_the_wu_kernel_in_k_blocks(D, monkeypatch):
    """The w/u kernel's K loop (LAUNCH["wu"]["BK"] below next_pow2(K): 2 blocks at K = 32, 4 with a partial last
    one at K = 60), in the forward and the backward's recompute (kg, qg too): outputs, final state and gradients as
    the recurrence's."""

    monkeypatch.setitem(launch_mod.LAUNCH["wu"], "BK", 16)
    q, k, v, g, beta, h0 = make_inputs(1, 40, 1, 2, D, 32, torch.float32)
    ref, out = grads_vs_naive(q, k, v, g, beta, h0)
    for name, r, x, ratio in zip(GRAD_NAMES, ref, out, GRAD_RATIOS, strict=True):
        assert_close(name, r, x, ratio)


@pytest.mark.parametrize("recompute", ["0", "1"], ids=["keep-states", "recompute"])
def test_chunk_gradients_with_split_scans(monkeypatch, recompute, kernel_env):
    """Both state scans at 32-wide V blocks (as on a GPU with more multiprocessors than programs): the same
    gradients as the recurrence's, with the forward's states kept (default) or recomputed by the backward."""

    kernel_env(K3_KDA_BWD="triton", K3_KDA_RECOMPUTE=recompute)
    monkeypatch.setitem(launch_mod.LAUNCH["scan"], "BV", 64)
    monkeypatch.setitem(launch_mod.LAUNCH["bwd_scan"], "BV", 64)
    seen = []

    def sms(dev):
        seen.append(dev)
        return 1000

    for mod in (fwd_mod, launch_mod, bwd_mod):  # each looks device_sms up as its own global
        monkeypatch.setattr(mod, "device_sms", sms)
    q, k, v, g, beta, h0 = make_inputs(1, 40, 1, 2, 32, 64, torch.float32)
    ref, out = grads_vs_naive(q, k, v, g, beta, h0)
    # the forward's choice of where its output is computed (fuse_output), the forward scan, the backward's
    # recompute (K3_KDA_RECOMPUTE=1) and the backward scan
    assert len(seen) == 3 + int(recompute)
    for name, r, x, ratio in zip(GRAD_NAMES, ref, out, GRAD_RATIOS, strict=True):
        assert_close(name, r, x, ratio)


SUB_CASES = [  # (B, T, H, HV, D, chunk_size, safe_gate, cu_seqlens)
    (2, 70, 1, 2, 32, 64, True, None),  # a partial last chunk with an empty sub-chunk
    (1, 45, 1, 1, 60, 32, False, None),  # exact diagonal path, K padded (60 -> 64)
    (1, 80, 1, 2, 32, 64, True, [0, 15, 15, 80]),  # varlen with an empty sequence
    (1, 24, 2, 2, 64, 16, True, None),  # one sub-chunk per chunk
]


def intra_reference(q, k, g, beta, scale, BT, cu):
    """float64 Gamma (log2 units), Aqk (j <= i), Akk (j < i, no beta) and L = diag(beta) Akk per chunk, by the
    definitions (kda.md 3.1: exact pairwise exponents), as [T_all, HV, *] like the kernels' buffers."""
    q, k, g, beta = (x.double().cpu() for x in (q, k, g, beta))
    B, T, H, K = q.shape
    HV = g.shape[2]
    q, k = (x.repeat_interleave(HV // H, dim=2).reshape(B * T, HV, K) for x in (q, k))
    g, beta = g.reshape(B * T, HV, K), beta.reshape(B * T, HV)
    bounds = list(itertools.pairwise(cu)) if cu else [(b * T, b * T + T) for b in range(B)]
    Gam = torch.zeros(B * T, HV, K, dtype=torch.float64)
    Aqk, Akk = (torch.zeros(B * T, HV, BT, dtype=torch.float64) for _ in range(2))
    for bos, eos in bounds:
        for c0 in range(bos, eos, BT):
            c1 = min(c0 + BT, eos)
            G = g[c0:c1].cumsum(0)  # [n, HV, K] nats
            Gam[c0:c1] = G / math.log(2)
            dec = (G[:, None] - G[None, :]).clamp_max(0).exp()  # [i, j, HV, K]; only j <= i is kept below
            n = c1 - c0
            lower = torch.tril(torch.ones(n, n, dtype=torch.bool))
            a = scale * torch.einsum("ihk,jhk,ijhk->ihj", q[c0:c1], k[c0:c1], dec)
            b = torch.einsum("ihk,jhk,ijhk->ihj", k[c0:c1], k[c0:c1], dec)
            Aqk[c0:c1, :, :n] = a * lower[:, None, :]
            Akk[c0:c1, :, :n] = b * lower.tril(-1)[:, None, :]
    return Gam, Aqk, Akk, Akk * beta[..., None]


@pytest.mark.parametrize("B,T,H,HV,D,BT,safe,cu", SUB_CASES, ids=[f"{case_id(*c[:5])}-BT{c[5]}-"
                         f"{'safe' if c[6] else 'exact'}{'-varlen' if c[7] else ''}" for c in SUB_CASES])
def test_intra_kernel_matches_float64_definitions(B, T, H, HV, D, BT, safe, cu, monkeypatch):
    """The forward's intra-chunk kernel (one program per sub-chunk) writes every element of Gamma and every block
    j <= i of Aqk and of Akk (a training forward) or L = diag(beta) Akk (an inference forward; its one buffer holds
    either; L in fp32, or in fp16 with l_fp16), equal to the float64 definitions; the buffers are NaN-poisoned
    (tests/conftest.py), so an element left unwritten fails. Also in K halves (LAUNCH["intra"]["KSPLIT_FROM"], with
    fp16 L): Gamma whole, L and Aqk as two fp16 partial sums each that add up to them (the solve adds L's, the
    output's reader Aqk's)."""

    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, D, D, torch.float32, N=None if cu is None else len(cu) - 1)
    g = g.clamp_min(-5.0) if safe else g
    cu_t = None if cu is None else torch.tensor(cu, device=DEV)
    safe_shift = 7.5 * 5.0 / 2 if safe else None
    ref = dict(zip(("Gam", "Aqk", "Akk", "Lkk"), intra_reference(q, k, g, beta, D**-0.5, BT, cu), strict=True))
    # the blocks j <= i of each chunk: column c, row r (positions inside the chunk)
    pos = torch.arange(q.shape[0] * q.shape[1])
    starts = torch.tensor(cu) if cu is not None else torch.arange(0, len(pos) + 1, q.shape[1])
    rel = pos - starts[torch.searchsorted(starts, pos, right=True) - 1]  # position in the sequence
    lower = (torch.arange(BT)[None, :] // 16 <= (rel % BT)[:, None] // 16)[:, None, :].expand(-1, HV, -1)
    for store_akk, l_fp16, split, names in ((True, False, 0, ("Gam", "Aqk", "Akk")), (False, False, 0, ("Lkk",)),
                                            (False, True, 0, ("Lkk",)), (False, True, 16, ("Gam", "Aqk", "Lkk"))):
        monkeypatch.setitem(launch_mod.LAUNCH["intra"], "KSPLIT_FROM", split)
        r = fwd_mod.chunk_fwd_pipeline(q, k, v, g, beta, h0, scale=D**-0.5, safe_shift=safe_shift,
                                       chunk_size=BT, cu_seqlens=cu_t, h_fp32=True, store_akk=store_akk,
                                       l_fp16=l_fp16)
        assert r["Lkk" if store_akk else "Akk"] is None
        for name in names:
            got, want = r[name], ref[name]
            if name == "Lkk":
                assert got.dtype == (torch.float16 if l_fp16 else torch.float32)
            if split and name in ("Lkk", "Aqk"):  # two fp16 partial sums
                assert got.dtype == torch.float16 and got.shape[0] == 2 and torch.isfinite(got[0][lower]).all()
                got = got.double().sum(0)
            got = got.double().cpu()
            if name in ("Akk", "Lkk", "Aqk"):  # the blocks j <= i (no others are written)
                got, want = got[lower], want[lower]
            assert torch.isfinite(got).all(), f"{name}: unwritten (NaN) or non-finite elements"
            tol = 1e-3 if l_fp16 and name != "Gam" else 1e-5
            assert_close(name + (" (fp16)" if l_fp16 else "") + (" (K split)" if split else ""), want, got, tol)


@pytest.mark.parametrize("source", ["L", "Akk-beta", "L-fp16"])
@pytest.mark.parametrize("BT,lens", [(64, [64, 70]), (32, [45]), (16, [24]), (64, [15, 0, 65])],
                         ids=["BT64-partial", "BT32", "BT16", "BT64-varlen"])
def test_solve_kernel_matches_float64_inverse(BT, lens, source):
    """The solve kernel writes M = (I + L)^-1 of every chunk's strictly lower-triangular L, as the float64 inverse,
    from L itself (fp32, or fp16: then the inverse of the fp16 values) or (a training forward) from Akk = L / beta,
    whose rows it scales by beta; the blocks above the diagonal blocks are NaN in its input (never read), the output
    is NaN-poisoned (every block j <= i must be written); a partial chunk's M is the inverse of its valid rows and
    columns."""

    torch.manual_seed(0)
    HV, BC = 2, 16
    cu = [0, *itertools.accumulate(lens)]
    T_all = cu[-1]
    _N, NT, NT_all, chunk_indices, _, cu_t = fwd_mod._layout_args(
        1, T_all, BT, torch.tensor(cu, device=DEV), DEV, None, None)
    # L as the intra kernel leaves it: strictly lower inside each chunk, zero above the diagonal in the diagonal
    # blocks, and (here) NaN in the blocks of later sub-chunks, which the solve must not read
    Lkk = torch.full((T_all, HV, BT), float("nan"))
    want = []
    for a, b in itertools.pairwise(cu):
        for c0 in range(a, b, BT):
            n = min(BT, b - c0)
            L = torch.randn(n, HV, BT) * 0.3
            if source == "L-fp16":  # the values an fp16 L holds
                L = L.half().float()
            r, c = torch.arange(n)[:, None], torch.arange(BT)[None, :]
            L = torch.where((c < r)[:, None, :], L, 0.0)  # [n, HV, BT]: strictly lower
            L = torch.where((c // BC > r // BC)[:, None, :], float("nan"), L)
            Lkk[c0:c0 + n] = L
            for h in range(HV):
                Lh = torch.nan_to_num(L[:, h, :n].double(), nan=0.0)
                want.append((c0, n, h, torch.linalg.inv(torch.eye(n, dtype=F64) + Lh)))
    Mm = torch.full((T_all, HV, BT), float("nan"), device=DEV)
    beta = 0.2 + 0.8 * torch.rand(T_all, HV)
    if source == "Akk-beta":  # the kernel gets Akk and beta: L = diag(beta) Akk (up to an fp32 rounding of the
        # division)
        Lkk = Lkk / beta[..., None]
    elif source == "L-fp16":
        Lkk = Lkk.half()
    if NT_all:
        fwd_mod._solve_kernel[(NT_all, HV)](Lkk.to(DEV), beta.to(DEV), Mm, chunk_indices, cu_t, T_all,
                                            NT, 0, HV=HV, BT=BT, BC=BC, NC=BT // BC, BETA=source == "Akk-beta",
                                            VARLEN=True, PREC="ieee", PARTS=1, **launch_mod.launch_opts("solve"))
    Mm = Mm.cpu()
    assert len(want) == sum(-(-n // BT) for n in lens) * HV
    for c0, n, h, M in want:
        r, c = torch.arange(n)[:, None], torch.arange(n)[None, :]
        got = Mm[c0:c0 + n, h, :n].double()
        lower_blocks = c // BC <= r // BC
        assert torch.isfinite(got[lower_blocks]).all(), f"chunk at {c0}, head {h}: a block j <= i unwritten"
        assert_close(f"M (chunk at {c0}, head {h})", M[lower_blocks], got[lower_blocks], 1e-6)


def test_intra_kernel_gate_bound_check():
    """With g_check the intra kernel leaves its flag set (1) while every g is at or above the floor, and clears it
    (0) when one g anywhere, here in the last partial chunk, is below; the pipeline then fails with the given message
    (chunk_kda's safe-gate check on a GPU). A g exactly at the floor passes."""

    B, T, H, HV, D, BT = 2, 70, 1, 2, 32, 64
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, D, D, torch.float32)
    g = g.clamp_min(-5.0)
    g[0, 3, 1, 7] = -5.0
    kw = {"scale": D**-0.5, "safe_shift": 7.5 * 5.0 / 2, "chunk_size": BT, "cu_seqlens": None, "h_fp32": True}
    r = fwd_mod.chunk_fwd_pipeline(q, k, v, g, beta, h0, g_check=(-5.0, "g below the floor"), **kw)
    assert r["g_ok"].tolist() == [1]
    g[1, 66, 1, 3] = -5.001
    if DEV == "cuda":  # a failed device-side assert poisons the CUDA context: the flag the assert would read
        seen = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "_assert_async", lambda flag, msg: seen.append(flag.tolist()))
            fwd_mod.chunk_fwd_pipeline(q, k, v, g, beta, h0, g_check=(-5.0, "g below the floor"), **kw)
        assert seen == [[0]]
        return
    with pytest.raises(RuntimeError, match="g below the floor"):
        fwd_mod.chunk_fwd_pipeline(q, k, v, g, beta, h0, g_check=(-5.0, "g below the floor"), **kw)


def test_set_launch_entry_parses_and_restores(monkeypatch):
    """set_launch_entry("NAME.KEY=VALUE") (kda_tune.py --set, K3_TEST_KDA_LAUNCH): an entry of either module's LAUNCH
    set to an int, a bool or a string, the replaced value returned for restoring; an unknown entry is a ValueError
    that names the known ones."""

    intra, scan = launch_mod.LAUNCH["bwd_intra"], launch_mod.LAUNCH["scan"]
    monkeypatch.setitem(intra, "num_stages", 3)  # (restored after the test, as the values set below)
    monkeypatch.setitem(intra, "PREC", "tf32")
    monkeypatch.setitem(scan, "SEGMENT_PRIORITY", True)
    assert launch_mod.set_launch_entry("bwd_intra.num_stages=4") == (intra, "num_stages", 3)
    assert intra["num_stages"] == 4
    assert launch_mod.set_launch_entry(" scan.SEGMENT_PRIORITY=False") == (scan, "SEGMENT_PRIORITY", True)
    assert scan["SEGMENT_PRIORITY"] is False
    assert launch_mod.set_launch_entry("bwd_intra.PREC=bf16")[2] == "tf32" and intra["PREC"] == "bf16"
    for bad in ("bwd_intra.nope=1", "nope.num_warps=1", "bwd_intra.num_warps"):
        with pytest.raises(ValueError, match="bwd_intra.num_warps"):
            launch_mod.set_launch_entry(bad)


def test_launch_fitting_falls_back_to_one_stage(monkeypatch):
    """A pipelined launch whose shared memory does not fit the device (Triton's OutOfResources, raised when it loads
    the kernel, before anything runs) is relaunched at 1 stage, and that signature goes straight to 1 stage after;
    another signature keeps its stages, and a launch refused at 1 stage raises."""
    from triton.runtime.errors import OutOfResources


    monkeypatch.setattr(common_mod, "_UNFIT", set())
    launches = []

    class Kernel:  # refuses more than 1 stage at K = 256, as the state scans' shared memory does on an H200
        __name__ = "_fake_scan"

        def __getitem__(self, grid):
            def run(*args, **kw):
                launches.append((kw["K"], kw["num_stages"]))
                if kw["K"] > 256 or (kw["K"] == 256 and kw["num_stages"] > 1):
                    raise OutOfResources(385024, 232448, "shared memory")
            return run

    x = torch.zeros(2)
    for K in (256, 256, 128):
        common_mod.launch_fitting(Kernel(), (1,), x, K=K, num_stages=3)
    assert launches == [(256, 3), (256, 1), (256, 1), (128, 3)]
    with pytest.raises(OutOfResources):  # nothing left to fall back to
        common_mod.launch_fitting(Kernel(), (1,), x, K=512, num_stages=1)
    assert launches[-1] == (512, 1)


def test_launch_spy_passes_launch_fitting(monkeypatch, launch_spy):
    """The tests' launch spy keeps the kernel's __name__, which launch_fitting reads once any launch was refused: on
    the H200 a refused fp32 launch earlier in the same pytest worker made a spied scan launch raise AttributeError
    (test_scan_v_block_16_with_few_sequences)."""

    monkeypatch.setattr(common_mod, "_UNFIT", {("_another_kernel",)})
    grids = launch_spy(fwd_mod, "_scan_kernel")
    q, k, v, g, beta, h0 = make_inputs(1, 20, 1, 1, 32, 32, torch.float32)
    with torch.no_grad():
        chunk_kda(q, k, v, g, beta, initial_state=h0)
    assert len(grids) == 1
