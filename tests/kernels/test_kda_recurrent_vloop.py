"""The opt-in V-block loop of the recurrent KDA kernel (triton_recurrent.LAUNCH["VLOOP"],
`_recurrent_kda_vloop_kernel`: one program per value head and sequence walks its state's V blocks, prefetching the
next block's tile) vs the float64 recurrence (kda.md section 6).

Every test runs with VLOOP on and checks, through a launch spy, that the loop kernel ran (grid (HV, N)) and the
one-block kernel did not. V blocks: V = 128 at BV = 32 (4 blocks: the prefetch crosses 3 block boundaries), V = 60 at
BV = 32 (2 blocks, the second partial and masked, K = 100 masked too) and V = 60 at BV = 64 (one masked block).
Outputs and final states are allocated by the wrapper with torch.empty, which tests/conftest.py NaN-poisons, so an
element the kernel fails to write fails the comparison. On a CPU the kernel runs under Triton's interpreter.
"""

import importlib.util
import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

# triton and the kernel modules were imported under the interpreter by tests/kernels/conftest.py
from k3.kernels import dispatch
from k3.kernels.kda import fused_recurrent_kda, l2norm, naive_kda_gate, naive_kda_lowerbound_gate, naive_recurrent_kda
from k3.kernels.kda import triton_recurrent as rec
from k3.kernels.kda.fused_recurrent import fused_recurrent_kda_torch
from k3.kernels.testing import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
# (K, V, BV): 4 V blocks; 2 blocks, the second partial, K and V masked; one masked block
BLOCKS = [(32, 128, 32), (100, 60, 32), (100, 60, 64)]
BLOCK_IDS = ["K32-V128-BV32", "K100-V60-BV32", "K100-V60-BV64"]


@pytest.fixture
def vloop(monkeypatch, triton_cpu, launch_spy):
    """K3_KERNELS=triton with LAUNCH["VLOOP"] on; yields set_bv(BV, *grids): the V block and the grids the test will
    launch, checked after it (conftest's launch spy): only the loop kernel ran, on those (value heads, sequences)
    grids."""
    monkeypatch.setenv("K3_KERNELS", "triton")
    dispatch.kernel_backend.cache_clear()
    monkeypatch.setitem(rec.LAUNCH, "VLOOP", True)
    loop, one_block = launch_spy(rec, "_recurrent_kda_vloop_kernel"), launch_spy(rec, "_recurrent_kda_kernel")
    expect = []

    def set_bv(bv, *grids):
        monkeypatch.setitem(rec.LAUNCH, "BV", bv)
        expect.extend(grids)

    yield set_bv
    dispatch.kernel_backend.cache_clear()
    assert one_block == []
    assert loop == expect, "the V-loop kernel did not run as expected"


def inputs(B, T, H, HV, K, V):
    """kda.md 6.2's recipe in fp32 on DEV: q, k L2-normalized U(0, 1), v U(0, 1), g = logsigmoid(N(0, 1)),
    beta = sigmoid(N(0, 1))."""
    q, k = (l2norm(torch.rand(B, T, H, K)).to(DEV) for _ in range(2))
    v = torch.rand(B, T, HV, V, device=DEV)
    g = F.logsigmoid(torch.randn(B, T, HV, K)).to(DEV)
    beta = torch.randn(B, T, HV).sigmoid().to(DEV)
    return q, k, v, g, beta


def reference(q, k, v, g, beta, h0):
    """float64 recurrence on the CPU: (o [B, T, HV, V], final states [B, HV, K, V])."""
    q, k, v, g, beta = (x.detach().to("cpu", F64) for x in (q, k, v, g, beta))
    return naive_recurrent_kda(q, k, v, g, beta, initial_state=None if h0 is None else h0.to("cpu", F64),
                               output_final_state=True)


def twin64(q, k, v, g, beta, **kw):
    """The PyTorch twin (fused_recurrent.py; test_kda.py checks it against the recurrence) in float64 on the CPU, for
    varlen and per-token slots: (o, final state). Tensors in kw go to the CPU, float ones as float64; a pool that
    already is a CPU float64 tensor is updated in place."""
    args = {"A_log": None, "dt_bias": None, "scale": None, "initial_state": None, "output_final_state": True,
            "use_qk_l2norm_in_kernel": False, "use_gate_in_kernel": False, "use_beta_sigmoid_in_kernel": False,
            "lower_bound": None, "cu_seqlens": None, "state_v_first": False, "ssm_state_indices": None,
            "num_accepted_tokens": None}
    args.update({n: x.to("cpu", F64) if x.is_floating_point() else x.cpu() for n, x in kw.items() if x is not None})
    return fused_recurrent_kda_torch(*(x.detach().to("cpu", F64) for x in (q, k, v, g, beta)), **args)


@pytest.mark.parametrize("state_v_first", [False, True], ids=["k-first", "v-first"])
@pytest.mark.parametrize("K,V,BV", BLOCKS, ids=BLOCK_IDS)
def test_vloop_pool_in_place(K, V, BV, state_v_first, vloop):
    """Pool slots [3, -1, 0] read and written in place over 2 tokens per sequence (token 1 takes the per-block
    path): slot -1 starts from zeros and writes nothing; slots 1, 2, 4 stay bit-identical."""
    B, T, H, HV = 3, 2, 1, 2
    vloop(BV, (HV, B))
    q, k, v, g, beta = inputs(B, T, H, HV, K, V)
    pool = torch.randn(5, HV, *((V, K) if state_v_first else (K, V)), device=DEV)
    before = pool.clone()
    idx = torch.tensor([3, -1, 0], device=DEV, dtype=torch.int32)
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx, output_final_state=True,
                               state_v_first=state_v_first)
    h0 = before[[3, 0, 0]].clone()
    h0[1] = 0.0
    to_kv = (lambda x: x.transpose(-1, -2)) if state_v_first else (lambda x: x)  # [.., K, V] <-> the pool's layout
    ro, rs = reference(q, k, v, g, beta, to_kv(h0))
    assert_close("o", ro, o, 0.005)
    assert_close("ht", to_kv(rs), s, 0.005)
    assert_close("pool[3]", to_kv(rs[0]), pool[3], 0.005)
    assert_close("pool[0]", to_kv(rs[2]), pool[0], 0.005)
    for untouched in (1, 2, 4):
        assert torch.equal(pool[untouched], before[untouched]), f"pool slot {untouched} changed"


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_vloop_decode_step_in_kernel_flags(gate, vloop):
    """The decode benchmark's call: one token per sequence, a pool addressed by reversed slots, q/k L2 norm, gate and
    beta sigmoid in the kernel, K = V = 128 in 4 blocks of 32."""
    B, H, D = 3, 2, 128
    vloop(32, (H, B))
    q, k = (torch.rand(B, 1, H, D, device=DEV) for _ in range(2))  # raw: normalized in the kernel
    v = torch.rand(B, 1, H, D, device=DEV)
    z, b_logit = torch.randn(B, 1, H, D, device=DEV), torch.randn(B, 1, H, device=DEV)
    A_log, dt_bias = torch.randn(H, device=DEV), torch.randn(H * D, device=DEV)
    lb = -5.0 if gate == "lower_bound" else None
    pool = torch.randn(B, H, D, D, device=DEV)
    before = pool.clone()
    idx = torch.arange(B - 1, -1, -1, device=DEV, dtype=torch.int32)
    o, _ = fused_recurrent_kda(q, k, v, z, b_logit, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                               ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, lower_bound=lb)
    z64, A64, b64 = z.to("cpu", F64), A_log.to("cpu", F64), dt_bias.to("cpu", F64)
    g = naive_kda_lowerbound_gate(z64, A64, b64, lb) if lb is not None else naive_kda_gate(z64, A64, b64)
    ro, rs = reference(l2norm(q.to(F64)), l2norm(k.to(F64)), v, g, b_logit.to(F64).sigmoid(), before[idx.long()])
    assert_close("o", ro, o, 0.002)
    assert_close("pool", rs[idx.long().argsort()], pool, 0.002)


@pytest.mark.parametrize("K,V,BV", BLOCKS[:2], ids=BLOCK_IDS[:2])
def test_vloop_varlen(K, V, BV, vloop):
    """cu_seqlens with an empty sequence, an initial and a final state; then neither (no state read or written)."""
    cu = [0, 3, 3, 10]
    N, HV = len(cu) - 1, 2
    vloop(BV, (HV, N), (HV, N))
    q, k, v, g, beta = inputs(1, cu[-1], 1, HV, K, V)
    h0 = torch.randn(N, HV, K, V, device=DEV)
    cu_t = torch.tensor(cu, device=DEV)
    ro, rs = twin64(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_t)
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_t)
    assert_close("o", ro, o, 0.005)
    assert_close("ht", rs, s, 0.005)
    o0, s0 = fused_recurrent_kda(q, k, v, g, beta, cu_seqlens=cu_t)
    assert s0 is None
    assert_close("o (h0 = 0)", twin64(q, k, v, g, beta, cu_seqlens=cu_t)[0], o0, 0.005)


@pytest.mark.parametrize("cu", [None, [0, 3, 4, 6]], ids=["padded", "varlen"])
@pytest.mark.parametrize("K,V,BV", BLOCKS[:2], ids=BLOCK_IDS[:2])
def test_vloop_speculative_slots(K, V, BV, cu, vloop):
    """num_accepted_tokens with [N, S_max] slots: sequence n starts from slot idx[n, nat[n] - 1] and the state after
    each of its tokens goes to idx[n, t] (-1: written nowhere); against the float64 PyTorch twin (test_kda.py checks
    the twin against the recurrence). Untouched slots stay bit-identical."""
    N, S_max, HV = 3, 3, 2
    vloop(BV, (HV, N))
    B, T = (N, S_max) if cu is None else (1, cu[-1])
    q, k, v, g, beta = inputs(B, T, 1, HV, K, V)
    pool = torch.randn(12, HV, K, V, device=DEV)
    idx = torch.tensor([[0, 1, 2], [5, -1, 6], [9, 3, 10]], device=DEV, dtype=torch.int32)
    nat = torch.tensor([2, 1, 3], device=DEV, dtype=torch.int32)
    cu_t = None if cu is None else torch.tensor(cu, device=DEV)
    pool64 = pool.to("cpu", F64)
    before = pool.clone()
    ro, _ = twin64(q, k, v, g, beta, initial_state=pool64, ssm_state_indices=idx, num_accepted_tokens=nat,
                   cu_seqlens=cu_t)
    o, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=nat,
                               cu_seqlens=cu_t)
    assert_close("o", ro, o, 0.005)
    lengths = [S_max] * N if cu is None else [b - a for a, b in itertools.pairwise(cu)]
    written = {int(idx[n, t]) for n in range(N) for t in range(lengths[n])}
    for slot in range(pool.shape[0]):
        if slot in written:
            assert_close(f"pool[{slot}]", pool64[slot], pool[slot], 0.005)
        else:
            assert torch.equal(pool[slot], before[slot]), f"untouched slot {slot} changed"


_COMPILE = r"""
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3.kernels.kda import triton_recurrent as R

TYPES = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "beta": "*bf16", "o": "*bf16", "cu_seqlens": "*i64",
         "slots": "*i32", "per_token": "*i32", "scale": "fp32", "lower_bound": "fp32"}
for fn in (R._recurrent_kda_vloop_kernel, R._recurrent_kda_kernel):
    cases = list(itertools.product([(128, 128, 32), (100, 60, 32)], (True, False), ("pool", "per_token", "h0", "none")))
    for (K, V, BV), t1, states in cases + [((128, 128, 64), True, "pool")]:  # + the decode step at BV 64
        varlen = v_first = states in ("per_token", "h0")
        pool = states in ("pool", "per_token")
        consts = {"H": 1, "HV": 2, "K": K, "V": V, "BK": 128, "BV": BV, "L2NORM": K == 128, "GATE": K == 128,
                  "LOWER_BOUND_GATE": not t1, "HAS_A_LOG": t1, "HAS_DT_BIAS": True, "BETA_SIGMOID": K == 128,
                  "HAS_H0": states != "none", "STORE_HT": not t1, "POOL": pool, "PER_TOKEN": states == "per_token",
                  "VARLEN": varlen, "NV": triton.cdiv(V, BV)}
        if t1:  # a GPU launch turns integer arguments equal to 1 into constants: T at decode, the unit state stride
            consts["T"] = 1
        if states != "none":
            consts["s0_k" if v_first else "s0_v"] = 1
        consts = {a: x for a, x in consts.items() if a in fn.arg_names}
        sig = {a: "constexpr" if a in consts else TYPES.get(a, "*fp32" if a[0] in "ghAd" else "i32")
               for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(a),): x for a, x in consts.items()})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        assert f".entry {fn.__name__}" in ptx, fn.__name__
print("compiled")
"""


def test_recurrent_kernels_compile_for_sm90():
    """Both recurrent kernels compile for the GPU (sm_90, Triton's front end, without a GPU) with pool, per-token,
    plain and no states (the last two varlen with V-first strides), K = V = 128 and K = 100 / V = 60, one token as a
    constant (a decode launch's specialisation) or a runtime T: the interpreter never compiles them, and a token-0-peeled form of
    the loop kernel crashed Triton's coalescing pass at T = 1 while it ran on the CPU. In a process of its own, without
    the interpreter (as test_kda_compile.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], check=False, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
