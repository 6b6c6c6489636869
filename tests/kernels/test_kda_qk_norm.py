"""The inference forward's q/k L2 norm inside the chunk kernels (triton_chunk.chunk_fwd_pipeline's qk_norm).

Without gradients, `use_qk_l2norm_in_kernel=True` launches no L2-norm pass: the intra and w/u kernels normalize the
raw q and k as they load them. Checked against the float64 recurrence on l2norm(q), l2norm(k), and against the
training path's forward (the Triton L2-norm pass, then the kernels on normalized q and k), with raw rows of norm far
from 1 so that a kernel that skipped the norm fails. Where the kernels cannot normalize (the w/u kernel's K loop in
blocks, or the intermediate states asked for) the forward falls back to the norm pass. CPU: Triton's interpreter
(tiny shapes); a GPU runs the same tests natively, in fp32 and bf16.
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

CASES = [  # (B, T, H, HV, D, chunk_size, safe_gate, cu_seqlens)
    (1, 70, 1, 2, 32, 64, True, None),  # GVA, a partial last chunk
    (2, 45, 1, 1, 60, 32, False, None),  # exact diagonal path, K padded (60 -> 64)
    (1, 80, 1, 2, 32, 64, True, [0, 15, 15, 80]),  # varlen with an empty sequence
    (1, 40, 2, 2, 64, 16, True, None),  # two q/k heads, one sub-chunk per chunk
]


@pytest.fixture
def norm_passes(monkeypatch):
    """The tensors triton_chunk.l2norm_triton (the L2-norm pass) is called on, in order."""
    calls = []
    real = triton_chunk.l2norm_triton

    def spy(x, *args, **kwargs):
        calls.append(x)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(triton_chunk, "l2norm_triton", spy)
    return calls


def _inputs(B, T, H, HV, D, dtype, N):
    """Raw q, k (rows of norm far from 1), v, g = logsigmoid (clamped at -5), beta, h0."""
    torch.manual_seed(0)
    q, k = 3 * torch.rand(B, T, H, D) - 1, 2 * torch.rand(B, T, H, D)
    v = torch.rand(B, T, HV, D)
    g = F.logsigmoid(torch.randn(B, T, HV, D)).clamp_min(-5.0)
    beta = torch.randn(B, T, HV).sigmoid()
    h0 = torch.randn(N, HV, D, D)
    return [x.to(DEV, dtype) for x in (q, k, v)] + [g.to(DEV), beta.to(DEV, dtype), h0.to(DEV)]


def _run(xs, BT, safe, cu, **kw):
    return chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm_in_kernel=True,
                     chunk_size=BT, safe_gate=safe, lower_bound=-5.0 if safe else None,
                     cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV), **kw)


def _reference(xs, cu):
    """float64 recurrence on l2norm(q), l2norm(k); varlen by a loop over sequences."""
    q, k, v, g, beta, h0 = (x.detach().double().cpu() for x in xs)
    q, k = l2norm(q), l2norm(k)
    bounds = [(0, q.shape[1])] if cu is None else list(itertools.pairwise(cu))
    outs, states = [], []
    for n, (a, b) in enumerate(bounds):
        h = h0 if cu is None else h0[n : n + 1]
        o, s = naive_recurrent_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h,
                                   output_final_state=True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("B,T,H,HV,D,BT,safe,cu", CASES,
                         ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-HV{c[3]}-D{c[4]}-BT{c[5]}-{'safe' if c[6] else 'exact'}"
                              f"{'-varlen' if c[7] else ''}" for c in CASES])
def test_inference_forward_normalizes_inside_the_kernels(norm_passes, B, T, H, HV, D, BT, safe, cu, dtype):
    xs = _inputs(B, T, H, HV, D, dtype, B if cu is None else len(cu) - 1)
    with torch.no_grad():
        o, s = _run(xs, BT, safe, cu)
    assert norm_passes == [], "the inference forward ran the L2-norm pass"
    ro, rs = _reference(xs, cu)
    ratio = 0.005 if dtype == torch.float32 else 0.01
    assert_close("o vs recurrence", ro, o, ratio)
    assert_close("ht vs recurrence", rs, s, ratio)
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    o_t, s_t = _run(leaves, BT, safe, cu)  # the training path: the norm pass, then the kernels
    assert [x.data_ptr() for x in norm_passes] == [leaves[0].data_ptr(), leaves[1].data_ptr()]
    # fp32: the same arithmetic up to where the norm's product rounds; bf16: the pass rounds q, k to bf16, the
    # kernels do not
    ratio = 1e-5 if dtype == torch.float32 else 0.01
    assert_close("o vs the training forward", o_t, o, ratio)
    assert_close("ht vs the training forward", s_t, s, ratio)


@pytest.mark.parametrize("why", ["wu-k-blocks", "intermediate-states"])
def test_falls_back_to_the_norm_pass(monkeypatch, norm_passes, why):
    """The w/u kernel normalizes k only when it holds a whole key row (K <= its K block); the output kernel (not
    fused into the scan, for return_intermediate_states) reads q itself: both take the L2-norm pass first."""
    B, T, H, HV, D, BT = 1, 40, 1, 2, 32, 32
    xs = _inputs(B, T, H, HV, D, torch.float32, B)
    kw = {}
    if why == "wu-k-blocks":
        monkeypatch.setitem(triton_chunk.LAUNCH["wu"], "BK", 16)
    else:
        kw["return_intermediate_states"] = True
    with torch.no_grad():
        o, s, *_ = _run(xs, BT, True, None, **kw)
    assert len(norm_passes) == 2, "expected the L2-norm pass for q and k"
    ro, rs = _reference(xs, None)
    assert_close("o vs recurrence", ro, o, 0.005)
    assert_close("ht vs recurrence", rs, s, 0.005)
