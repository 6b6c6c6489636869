"""KDA kernels vs the naive float64 recurrence (kda.md section 6), plus state handoff, pools and validation.

Metric (kda.md 6.1, fla's assert_close): pass if max |ref - out| <= 1e-6, else no NaN and
rms(ref - out) / (rms(ref) + 1e-8) < ratio. float64 cases use tight ratios; fp32 cases the fla thresholds (6.2).
"""

import pytest
import torch
import torch.nn.functional as F

from k3.kernels import dispatch
from k3.kernels.kda import (
    chunk_kda,
    fused_recurrent_kda,
    l2norm,
    naive_chunk_kda,
    naive_kda_gate,
    naive_kda_lowerbound_gate,
    naive_recurrent_kda,
)
from k3.kernels.kda.chunk_torch import unit_lower_inverse
from k3.kernels.testing import assert_close

pytestmark = pytest.mark.usefixtures("single_thread")  # tests/kernels/conftest.py


F64 = torch.float64
F32 = torch.float32
TIGHT = 1e-10  # float64 vs float64: only rounding differences




def make_inputs(B, T, H, HV, K, V, dtype, normalizer=1.0, h0=True, N=None):
    """fla recipe (kda.md 6.2): q, k ~ U(0,1) (L2-normalized here), v ~ U(0,1), beta = sigmoid(N(0,1)),
    g = logsigmoid(N(0,1)) / normalizer, h0 ~ N(0,1) fp32 (float64 for float64 runs)."""
    q = l2norm(torch.rand(B, T, H, K, dtype=dtype))
    k = l2norm(torch.rand(B, T, H, K, dtype=dtype))
    v = torch.rand(B, T, HV, V, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, K, dtype=dtype)) / normalizer
    beta = torch.randn(B, T, HV, dtype=dtype).sigmoid()
    sdt = F64 if dtype == F64 else F32
    state = torch.randn(N or B, HV, K, V, dtype=sdt) if h0 else None
    return q, k, v, g, beta, state


def grads_of(fn, inputs, do, dht):
    """(o, ht, *d inputs) for loss = sum(o * do) + sum(ht * dht); None inputs give None gradients."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in inputs]
    o, ht = fn(*leaves)
    loss = (o * do).sum() + ((ht * dht).sum() if dht is not None else 0)
    live = [x for x in leaves if x is not None]
    gs = iter(torch.autograd.grad(loss, live))
    return [o, ht] + [next(gs) if x is not None else None for x in leaves]


def case_id(B, T, H, HV, D, dtype):
    return f"B{B}-T{T}-H{H}-HV{HV}-D{D}-{str(dtype).split('.')[-1]}"


# -------------------------------------------------------------------------------------------------- recurrence forms


def matrix_form_recurrence(q, k, v, g, beta, scale, h0):
    """S_t = (I - beta k k^T) Diag(alpha) S_{t-1} + beta k v^T, o_t = S_t^T (scale q): the paper's form, float64."""
    _, T, H, K = q.shape
    HV = v.shape[2]
    rep = HV // H
    S = h0.clone()
    eye = torch.eye(K, dtype=F64)
    outs = []
    for t in range(T):
        kt = k[:, t].repeat_interleave(rep, 1)  # [B, HV, K]
        P = eye - beta[:, t, :, None, None] * kt.unsqueeze(-1) * kt.unsqueeze(-2)
        S = P @ (g[:, t].exp().unsqueeze(-1) * S) + beta[:, t, :, None, None] * kt.unsqueeze(-1) * v[:, t].unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t].repeat_interleave(rep, 1), S))
    return torch.stack(outs, 1), S


def test_recurrence_forms_agree():
    q, k, v, g, beta, h0 = make_inputs(2, 40, 1, 2, 16, 12, F64)
    o1, s1 = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, s2 = matrix_form_recurrence(q, k, v, g, beta, 16**-0.5, h0)
    assert (o1 - o2).abs().max() < 1e-13 and (s1 - s2).abs().max() < 1e-13


@pytest.mark.parametrize("BT", [16, 32, 64])
@pytest.mark.parametrize("dtype", [F64, F32])
def test_naive_chunk_matches_recurrent(BT, dtype):
    q, k, v, g, beta, h0 = make_inputs(2, 128, 1, 2, 32, 16, dtype)
    o1, s1 = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, s2 = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=BT)
    ratio = TIGHT if dtype == F64 else 0.005
    assert_close("o", o1, o2, ratio)
    assert_close("ht", s1, s2, ratio)


@pytest.mark.parametrize("n", [1, 2, 16, 64])
def test_unit_lower_inverse(n):
    L = (torch.rand(3, 2, n, n, dtype=F64) * 0.5).tril(-1)  # like beta_i k_i.k_j decay: entries in [0, 1)
    M = unit_lower_inverse(L)
    eye = torch.eye(n, dtype=F64)
    assert (M @ (eye + L) - eye).abs().max() < 1e-10
    ref = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False)
    assert_close("M", ref, M, TIGHT)


# --------------------------------------------------------------------------------------- chunk vs recurrent, fwd + bwd

CHUNK_CASES = [  # (B, T, H, HV, D, BT, normalizer)
    (1, 63, 1, 1, 64, 64, 1.0),
    (1, 100, 1, 2, 60, 32, 1.0),
    (2, 130, 1, 2, 32, 16, 0.1),
    (1, 64, 2, 2, 32, 64, 10.0),
]

FP32_RATIOS = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "db": 0.02, "dh0": 0.008}
_REFERENCE_CACHE: dict = {}


def _chunk_case(B, T, H, HV, D, normalizer, safe_gate):
    """Float64 inputs and the naive-recurrence reference (o, ht, grads), computed once per case."""
    key = (B, T, H, HV, D, normalizer, safe_gate)
    if key not in _REFERENCE_CACHE:
        gen = torch.random.fork_rng()
        with gen:
            torch.manual_seed(hash(key) % 2**31)
            inputs = list(make_inputs(B, T, H, HV, D, D, F64, normalizer, h0=T != 100))  # one case without h0
            if safe_gate:
                inputs[3] = inputs[3].clamp(min=-5.0)  # the safe path needs g >= lower_bound (kda.md 3.3)
            do = torch.randn(B, T, HV, D, dtype=F64)
            dht = torch.randn(B, HV, D, D, dtype=F64)
        ref = grads_of(lambda *a: naive_recurrent_kda(*a[:5], initial_state=a[5], output_final_state=True),
                       inputs, do, dht)
        _REFERENCE_CACHE[key] = (inputs, do, dht, ref)
    return _REFERENCE_CACHE[key]


@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("safe_gate", [False, True], ids=["exact", "safe_gate"])
@pytest.mark.parametrize("B,T,H,HV,D,BT,normalizer", CHUNK_CASES,
                         ids=[case_id(*c[:5], "") + f"BT{c[5]}" for c in CHUNK_CASES])
def test_chunk_fwd_bwd(B, T, H, HV, D, BT, normalizer, safe_gate, dtype):
    inputs, do, dht, ref = _chunk_case(B, T, H, HV, D, normalizer, safe_gate)
    cast = [x.to(dtype) if x is not None else None for x in inputs]
    if cast[5] is not None:
        cast[5] = cast[5].to(F64 if dtype == F64 else F32)  # the state stays fp32
    out = grads_of(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=BT,
                                        safe_gate=safe_gate, lower_bound=-5.0 if safe_gate else None),
                   cast, do.to(dtype), dht.to(F64 if dtype == F64 else F32))
    for name, r, o in zip(["o", "ht", "dq", "dk", "dv", "dg", "db", "dh0"], ref, out):
        if r is None:
            assert o is None
            continue
        assert o.dtype == (F64 if dtype == F64 else F32), name
        assert_close(name, r, o, TIGHT if dtype == F64 else FP32_RATIOS[name])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_chunk_half_precision_inputs(dtype):
    """bf16/fp16 inputs: fp32 compute, output in the input dtype, fp32 state (kda.md 6.1: reference on the same
    rounded inputs)."""
    q, k, v, g, beta, h0 = make_inputs(2, 70, 1, 2, 32, 16, F32)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    o_ref, s_ref = naive_recurrent_kda(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double(),
                                       output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == dtype and s.dtype == F32
    assert_close("o", o_ref, o, 0.005)
    assert_close("ht", s_ref, s, 0.005)


def test_chunk_without_final_state_and_extreme_gates():
    """g = -1000 entries and half the gates zeroed (kda.md 6.2): the exact pairwise path stays finite and correct."""
    q, k, v, g, beta, h0 = make_inputs(1, 70, 1, 1, 32, 16, F32)
    g = g.masked_fill(torch.rand_like(g) < 0.5, 0.0)
    g = g.masked_fill(torch.rand_like(g) < 0.05, -1000.0)
    o_ref, _ = naive_recurrent_kda(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double())
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, chunk_size=32)
    assert ht is None
    assert_close("o", o_ref, o, 0.005)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    chunk_kda(*leaves, chunk_size=32)[0].sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


def test_varlen_matches_per_sequence_loop():
    cu = torch.tensor([0, 15, 100, 130])
    N, T = 3, 130
    q, k, v, g, beta, h0 = make_inputs(1, T, 1, 2, 32, 16, F64, N=N)
    do = torch.randn(1, T, 2, 16, dtype=F64)
    dht = torch.randn(N, 2, 32, 16, dtype=F64)

    def per_sequence(q, k, v, g, beta, h0):
        outs, states = [], []
        for n in range(N):
            sl = slice(int(cu[n]), int(cu[n + 1]))
            o, s = naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                       initial_state=h0[n : n + 1], output_final_state=True)
            outs.append(o)
            states.append(s)
        return torch.cat(outs, 1), torch.cat(states)

    inputs = [q, k, v, g, beta, h0]
    ref = grads_of(per_sequence, inputs, do, dht)
    out = grads_of(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cu,
                                        chunk_size=32), inputs, do, dht)
    for name, r, o in zip(["o", "ht", "dq", "dk", "dv", "dg", "db", "dh0"], ref, out):
        assert_close(name, r, o, TIGHT)
    o32, s_f32 = chunk_kda(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0.float(),
                         output_final_state=True, cu_seqlens=cu)
    assert_close("o fp32", ref[0], o32, 0.005)
    assert_close("ht fp32", ref[1], s_f32, 0.005)
    of, sf = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert_close("o fused", ref[0], of, TIGHT)
    assert_close("ht fused", ref[1], sf, TIGHT)


# ----------------------------------------------------------------------------------------------- in-kernel steps


@pytest.mark.parametrize("gate", ["lowerbound", "lowerbound_no_A", "softplus"])
def test_in_kernel_steps_equal_explicit_pipeline(gate):
    B, T, H, HV, K, V = 1, 50, 1, 2, 32, 16
    dtype = F64
    q, k = torch.rand(B, T, H, K, dtype=dtype), torch.rand(B, T, H, K, dtype=dtype)
    v = torch.rand(B, T, HV, V, dtype=dtype)
    z = torch.randn(B, T, HV, K, dtype=dtype)
    b_logit = torch.randn(B, T, HV, dtype=dtype)
    A_log = torch.randn(HV, dtype=dtype) if gate != "lowerbound_no_A" else None
    dt_bias = torch.randn(HV * K, dtype=dtype)
    lb = None if gate == "softplus" else -5.0
    do = torch.randn(B, T, HV, V, dtype=dtype)
    dht = torch.randn(B, HV, K, V, dtype=dtype)

    def explicit(q, k, v, z, b_logit, A_log, dt_bias):
        g = naive_kda_gate(z, A_log, dt_bias) if lb is None else naive_kda_lowerbound_gate(z, A_log, dt_bias, lb)
        return naive_recurrent_kda(l2norm(q), l2norm(k), v, g, b_logit.sigmoid(), output_final_state=True)

    def fused(fn, **extra):
        def run(q, k, v, z, b_logit, A_log, dt_bias):
            return fn(q, k, v, z, b_logit, A_log=A_log, dt_bias=dt_bias, lower_bound=lb, output_final_state=True,
                      use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      **extra)
        return run

    inputs = [q, k, v, z, b_logit, A_log, dt_bias]
    names = ["o", "ht", "dq", "dk", "dv", "dz", "db_logit", "dA_log", "ddt_bias"]
    ref = grads_of(explicit, inputs, do, dht)
    for fn, extra in ((chunk_kda, {"safe_gate": lb is not None}), (chunk_kda, {}), (fused_recurrent_kda, {})):
        out = grads_of(fused(fn, **extra), inputs, do, dht)
        for name, r, o in zip(names, ref, out):
            if r is None:
                assert o is None
                continue
            assert_close(f"{fn.__name__} {name}", r, o, TIGHT)


def test_gate_formulas():
    z = torch.zeros(1, 1, 2, 3, dtype=F64)
    A_log = torch.tensor([0.0, 1.0], dtype=F64)
    # softplus gate at z = dt_bias = 0: -exp(A_log) * ln 2
    g = naive_kda_gate(z, A_log)
    assert torch.allclose(g[0, 0, :, 0], -torch.exp(A_log) * torch.log(torch.tensor(2.0, dtype=F64)))
    # lower-bound gate at zero input: lb * sigmoid(0) = lb / 2, whatever A_log
    assert torch.allclose(naive_kda_lowerbound_gate(z, A_log, None, -4.0), torch.full_like(z, -2.0))
    zz = torch.randn(2, 5, 2, 3, dtype=F64) * 3
    gl = naive_kda_lowerbound_gate(zz, A_log, torch.randn(6, dtype=F64), -5.0)
    assert bool((gl > -5.0).all()) and bool((gl < 0).all())  # open interval (lb, 0) in float64
    gl32 = naive_kda_lowerbound_gate(zz.float(), A_log.float(), None, -5.0)
    assert gl32.dtype == F32 and bool((gl32 >= -5.0).all()) and bool((gl32 <= 0).all())  # fp32 sigmoid saturates


# ------------------------------------------------------------------------------------------ state layout and states


def test_state_v_first_equals_k_first():
    q, k, v, g, beta, h0 = make_inputs(2, 40, 1, 2, 32, 16, F32)
    do = torch.randn_like(v)
    dht = torch.randn_like(h0)
    kf = grads_of(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True),
                  [q, k, v, g, beta, h0], do, dht)
    vf = grads_of(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, state_v_first=True),
                  [q, k, v, g, beta, h0.transpose(-1, -2).contiguous()], do, dht.transpose(-1, -2))
    for name, a, b in zip(["o", "ht", "dq", "dk", "dv", "dg", "db", "dh0"], kf, vf):
        b = b.transpose(-1, -2) if name in ("ht", "dh0") else b
        assert_close(name, a, b, 1e-4)
    of, sf = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0.transpose(-1, -2).contiguous(),
                                 output_final_state=True, state_v_first=True)
    assert_close("fused o", kf[0], of, 1e-4)
    assert_close("fused ht", kf[1], sf.transpose(-1, -2), 1e-4)


@pytest.mark.parametrize("BT", [16, 32, 64])
def test_intermediate_states_are_prefix_final_states(BT):
    T = 150
    q, k, v, g, beta, h0 = make_inputs(1, T, 1, 1, 32, 16, F32)
    _, _, h = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=BT,
                        return_intermediate_states=True)
    NT = -(-T // BT)
    assert h.shape == (1, NT, 1, 32, 16) and h.dtype == F32
    assert_close("h[0]", h0, h[:, 0], 1e-7)
    for c in range(1, NT):
        _, s = chunk_kda(q[:, : c * BT], k[:, : c * BT], v[:, : c * BT], g[:, : c * BT], beta[:, : c * BT],
                         initial_state=h0, output_final_state=True, chunk_size=BT)
        assert_close(f"h[{c}]", s, h[:, c], 1e-5)
    # varlen: [1, total chunks, ...], sequence after sequence
    cu = torch.tensor([0, 40, T])
    h0v = torch.randn(2, 1, 32, 16)
    _, _, hv = chunk_kda(q, k, v, g, beta, initial_state=h0v, cu_seqlens=cu, chunk_size=BT,
                         return_intermediate_states=True)
    n0 = -(-40 // BT)
    assert hv.shape[1] == n0 + -(-(T - 40) // BT)
    assert_close("varlen h seq1 start", h0v[1:], hv[:, n0], 1e-7)


@pytest.mark.parametrize("safe_gate", [False, True])
def test_no_dependence_on_later_tokens(safe_gate):
    """Changing or appending tokens after t leaves outputs and chunk-boundary states at <= t bit-identical."""
    T, t, BT = 80, 37, 16
    q, k, v, g, beta, h0 = make_inputs(1, T, 1, 1, 32, 16, F32)
    kw = {"initial_state": h0, "chunk_size": BT, "return_intermediate_states": True, "safe_gate": safe_gate,
              "lower_bound": -5.0 if safe_gate else None}
    if safe_gate:
        g = g.clamp(min=-5.0)
    o, _, h = chunk_kda(q, k, v, g, beta, **kw)
    changed = [x.clone() for x in (q, k, v, g, beta)]
    for x in changed:
        x[:, t + 1 :] = torch.rand_like(x[:, t + 1 :]) * (-1 if x is changed[3] else 1)
    o2, _, h2 = chunk_kda(*changed, **kw)
    assert torch.equal(o[:, : t + 1], o2[:, : t + 1])
    n_fixed = t // BT + 1  # chunks starting at or before t
    assert torch.equal(h[:, :n_fixed], h2[:, :n_fixed])
    longer = [torch.cat([x, x[:, :20]], 1) for x in (q, k, v, g, beta)]
    o3, _, h3 = chunk_kda(*longer, **kw)
    assert torch.equal(o, o3[:, :T]) and torch.equal(h, h3[:, : h.shape[1]])


@pytest.mark.parametrize("dtype", [F64, F32])
def test_recurrent_decode_continues_chunk_prefill(dtype):
    T, T0 = 90, 67
    q, k, v, g, beta, h0 = make_inputs(2, T, 1, 1, 32, 16, dtype)
    o_full, s_full = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_pre, s = chunk_kda(q[:, :T0], k[:, :T0], v[:, :T0], g[:, :T0], beta[:, :T0], initial_state=h0,
                         output_final_state=True)
    outs = [o_pre]
    for t in range(T0, T):
        o_t, s = fused_recurrent_kda(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                                     beta[:, t : t + 1], initial_state=s, output_final_state=True)
        outs.append(o_t)
    ratio = TIGHT if dtype == F64 else 1e-5
    assert_close("o", o_full, torch.cat(outs, 1), ratio)
    assert_close("ht", s_full, s, ratio)


# --------------------------------------------------------------------------------------------- fused recurrent


@pytest.mark.parametrize("B,T,H,HV,D,dtype", [(2, 33, 2, 4, 60, F32), (1, 20, 1, 1, 32, F64)],
                         ids=[case_id(2, 33, 2, 4, 60, F32), case_id(1, 20, 1, 1, 32, F64)])
def test_fused_recurrent_matches_naive(B, T, H, HV, D, dtype):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, D, 24, dtype)
    o_ref, s_ref = naive_recurrent_kda(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double(),
                                       output_final_state=True)
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == dtype and s.dtype == (F64 if dtype == F64 else F32)
    assert_close("o", o_ref, o, 0.005)
    assert_close("ht", s_ref, s, 0.005)


def test_fused_recurrent_state_pool():
    P, HV, K, V = 6, 2, 16, 8
    q, k, v, g, beta, _ = make_inputs(3, 5, 1, HV, K, V, F32, h0=False)
    pool = torch.randn(P, HV, K, V)
    before = pool.clone()
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)  # -1: no slot (zero start, no write)
    init = torch.stack([before[4], torch.zeros(HV, K, V), before[1]])
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True)
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx, output_final_state=True)
    assert_close("o", o_ref, o, 1e-6)
    assert_close("ht", s_ref, s, 1e-6)
    assert_close("pool[4]", s_ref[0], pool[4], 1e-6)
    assert_close("pool[1]", s_ref[2], pool[1], 1e-6)
    untouched = [0, 2, 3, 5]
    assert torch.equal(pool[untouched], before[untouched])


def test_fused_recurrent_speculative_slots():
    """num_accepted_tokens: start from slot idx[n, accepted-1]; the state after token t goes to slot idx[n, t]."""
    P, HV, K, V, T = 10, 1, 16, 8, 3
    q, k, v, g, beta, _ = make_inputs(2, T, 1, HV, K, V, F32, h0=False)
    pool = torch.randn(P, HV, K, V)
    before = pool.clone()
    idx = torch.tensor([[0, 1, 2], [5, 6, 7]])
    accepted = torch.tensor([2, 1])
    init = torch.stack([before[1], before[5]])
    o, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx,
                               num_accepted_tokens=accepted)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, initial_state=init)
    assert_close("o", o_ref, o, 1e-6)
    for t in range(T):
        _, s_t = naive_recurrent_kda(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1], beta[:, : t + 1],
                                     initial_state=init, output_final_state=True)
        assert_close(f"slot t={t}", s_t, pool[idx[:, t]], 1e-6)
    assert torch.equal(pool[[3, 4, 8, 9]], before[[3, 4, 8, 9]])


# --------------------------------------------------------------------------------------- validation and dispatch


def test_validation_errors_are_readable():
    q, k, v, g, beta, h0 = make_inputs(2, 8, 1, 1, 16, 8, F32)
    cases = [
        (lambda: chunk_kda(q, k[:, :, :, :8], v, g, beta), "q and k must have the same shape"),
        (lambda: chunk_kda(q, k, v, g[..., :8], beta), "g must be [B, T, HV, K]"),
        (lambda: chunk_kda(q, k, v, g, beta, initial_state=h0.double()), "initial_state must be float32"),
        (lambda: chunk_kda(q, k, v, g, beta, initial_state=h0[:1]), "initial_state must be [N, HV, K, V]"),
        (lambda: chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8])), "cu_seqlens requires B == 1"),
        (lambda: chunk_kda(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 9])), "end at T=8"),
        (lambda: chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, lower_bound=-6.0), "lower_bound must lie"),
        (lambda: chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True), "needs A_log"),
        (lambda: chunk_kda(q, k, v, g, beta, A_log=torch.zeros(1)), "only used with use_gate_in_kernel"),
        (lambda: chunk_kda(q, k, v, g, beta, chunk_size=48), "chunk_size must be one of"),
        (lambda: chunk_kda(q, k, v, g - 10.0, beta, safe_gate=True, lower_bound=-5.0), "clamp g"),
        (lambda: chunk_kda(q, k, v, g, beta, safe_gate=True, use_gate_in_kernel=True, A_log=torch.zeros(1)),
         "softplus gate is unbounded"),
        (lambda: fused_recurrent_kda(q, k, v, g, beta, num_accepted_tokens=torch.tensor([1, 1])),
         "needs ssm_state_indices"),
        (lambda: fused_recurrent_kda(q, k, v, g, beta, ssm_state_indices=torch.tensor([0, 0]),
                                     initial_state=torch.zeros(3, 1, 16, 8)), "same pool slot"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            fn()
    with pytest.raises(NotImplementedError, match="allow_neg_eigval"):
        chunk_kda(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        fused_recurrent_kda(q, k, v, g, beta, head_first=True)


def test_kernel_backend_dispatch(monkeypatch):
    assert dispatch.kernel_backend() == "torch"  # conftest sets K3_KERNELS=torch
    assert dispatch.parse_backend("torch") == "torch"
    # unset: triton exactly when a CUDA GPU is present and triton imports
    assert dispatch.parse_backend(None) == ("triton" if dispatch.triton_kernels_available() else "torch")
    if not torch.cuda.is_available():  # without a GPU (and without the interpreter) asking for triton is an error
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(dispatch.KernelBackendError, match="Triton KDA kernels are not available.*K3_KERNELS=torch"):
            dispatch.parse_backend("triton")
    with pytest.raises(dispatch.KernelBackendError, match="not a kernel backend"):
        dispatch.parse_backend("cuda")


def test_trusted_inputs_scope_and_cpu_checks_stay():
    """dispatch.trusted_inputs() is scoped (nests, resets on exit and on error); value checks of CPU tensors run
    inside it too (they cost no GPU wait), so bad offsets are still named."""
    assert not dispatch.inputs_trusted()
    with dispatch.trusted_inputs():
        assert dispatch.inputs_trusted()
        with dispatch.trusted_inputs():
            assert dispatch.inputs_trusted()
        assert dispatch.inputs_trusted()
    assert not dispatch.inputs_trusted()
    with pytest.raises(RuntimeError), dispatch.trusted_inputs():
        raise RuntimeError("boom")
    assert not dispatch.inputs_trusted()
    q = torch.randn(1, 6, 1, 8)
    g = -torch.rand(1, 6, 1, 8)
    with dispatch.trusted_inputs(), pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        chunk_kda(q, q, q, g, torch.rand(1, 6, 1), cu_seqlens=torch.tensor([0, 4, 5]))
