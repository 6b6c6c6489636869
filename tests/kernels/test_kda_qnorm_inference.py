"""An inference forward of the Triton chunk_kda with use_qk_l2norm_in_kernel=True normalises q inside the forward's
intra kernel (NORM_Q), not in a pass of its own: the scan computes the output there, so that kernel is q's only
reader (triton_chunk.chunk_kda_triton). k keeps its pass (three kernels read it).

Checked here: the path is taken exactly when it should be (the norm pass runs for k alone: once per forward, not
twice), the output and final state against the float64 recurrence on l2norm(q), l2norm(k) with raw q, k whose row
norms are far from 1, and against the training forward on the same inputs (which normalises q in the pass). The
fallbacks (the intermediate states asked for, or the output kernel instead of the fused scan) normalise q by the
pass. CPU: Triton's interpreter (tiny shapes); on a GPU also bf16.
"""

import importlib.util
import itertools

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

# after the skip; conftest imported the kernel modules under the interpreter on a CPU
from k3.kernels.kda import chunk_kda, l2norm, naive_recurrent_kda, triton_chunk
from k3.kernels.testing import assert_close

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]


pytestmark = pytest.mark.usefixtures("triton_kda_backward")  # tests/kernels/conftest.py


@pytest.fixture
def norm_calls(monkeypatch):
    """The row counts of every L2-norm pass chunk_kda runs (triton_chunk.l2norm_triton, looked up at call time)."""
    calls = []
    real = triton_chunk.l2norm_triton

    def counted(x, *a):
        calls.append(x.shape)
        return real(x, *a)

    monkeypatch.setattr(triton_chunk, "l2norm_triton", counted)
    return calls


def raw_inputs(B, T, H, HV, D, dtype, N=None):
    """q, k with row norms from ~0.3 to ~10 (so a missing or doubled norm shows), the rest as kda.md 6.2."""
    torch.manual_seed(0)
    q = torch.randn(B, T, H, D) * torch.rand(B, T, H, 1).mul(3).exp() * 0.3
    k = torch.randn(B, T, H, D) * torch.rand(B, T, H, 1).mul(3).exp() * 0.3
    v = torch.rand(B, T, HV, D)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, D)).clamp_min(-5.0)
    beta = torch.randn(B, T, HV).sigmoid()
    h0 = torch.randn(N or B, HV, D, D)
    q, k, v, beta = (x.to(DEV, dtype) for x in (q, k, v, beta))
    return q, k, v, g.to(DEV), beta, h0.to(DEV)


def reference(q, k, v, g, beta, h0, cu=None):
    """float64 recurrence on l2norm(q), l2norm(k); varlen by a loop over sequences."""
    q, k, v, g, beta, h0 = (x.detach().double().cpu() for x in (q, k, v, g, beta, h0))
    q, k = l2norm(q), l2norm(k)
    bounds = [(0, q.shape[1])] if cu is None else list(itertools.pairwise(cu))
    outs, states = [], []
    for n, (a, b) in enumerate(bounds):
        o, s = naive_recurrent_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                   initial_state=h0[n : n + 1] if cu is not None else h0, output_final_state=True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states)


CASES = [  # (B, T, H, HV, D, chunk size, safe gate, cu_seqlens)
    (2, 70, 1, 2, 32, 64, True, None),  # GVA: two value heads read one q head
    (1, 45, 2, 2, 128, 64, True, None),
    (1, 50, 1, 1, 100, 32, False, None),  # K = 100: masked columns stay out of the row norm
    (1, 80, 1, 1, 64, 64, True, [0, 15, 80]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("B,T,H,HV,D,BT,safe,cu", CASES, ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-HV{c[3]}-D{c[4]}-BT{c[5]}"
                                                            f"{'-varlen' if c[7] else ''}" for c in CASES])
def test_inference_forward_normalises_q_in_the_intra_kernel(B, T, H, HV, D, BT, safe, cu, dtype, norm_calls):
    q, k, v, g, beta, h0 = raw_inputs(B, T, H, HV, D, dtype, N=None if cu is None else len(cu) - 1)
    kw = {"initial_state": h0, "output_final_state": True, "chunk_size": BT, "safe_gate": safe,
          "lower_bound": -5.0 if safe else None, "use_qk_l2norm_in_kernel": True,
          "cu_seqlens": None if cu is None else torch.tensor(cu, device=DEV)}
    with torch.no_grad():
        o, s = chunk_kda(q, k, v, g, beta, **kw)
    assert norm_calls == [k.shape], "the inference forward runs the norm pass for k alone"
    ro, rs = reference(q, k, v, g, beta, h0, cu)
    ratio = 0.005 if dtype == torch.float32 else 0.01
    assert_close("o", ro, o, ratio)
    assert_close("ht", rs, s, ratio)
    # the training forward (q through the pass, Akk and kept states) on the same inputs: the same values up to the
    # order of the row sums of the two norms (fp32), and the rounding of q to its dtype where that order flips a bit
    norm_calls.clear()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o_t, s_t = chunk_kda(*leaves, g, beta, **kw)
    assert norm_calls == [q.shape, k.shape]
    assert_close("o vs the training forward", o_t.detach(), o, 1e-5 if dtype == torch.float32 else 0.004)
    assert_close("ht vs the training forward", s_t.detach(), s, 1e-5 if dtype == torch.float32 else 0.004)


def test_inference_forward_falls_back_to_the_pass_when_q_has_other_readers(norm_calls, monkeypatch):
    """return_intermediate_states (the output kernel reads q, and the states are asked for) and a forward whose
    output is not fused into the scan (LAUNCH["scan"]["OUTPUT_FROM"] above the scan's programs) normalise q by the
    pass; the results still match the float64 recurrence."""
    q, k, v, g, beta, h0 = raw_inputs(1, 70, 1, 1, 32, torch.float32)
    ro, rs = reference(q, k, v, g, beta, h0)
    kw = {"initial_state": h0, "output_final_state": True, "safe_gate": True, "lower_bound": -5.0,
          "use_qk_l2norm_in_kernel": True}
    with torch.no_grad():
        o, s, _ = chunk_kda(q, k, v, g, beta, return_intermediate_states=True, **kw)
    assert norm_calls == [q.shape, k.shape]
    assert_close("o (intermediate states)", ro, o, 0.005)
    assert_close("ht (intermediate states)", rs, s, 0.005)
    norm_calls.clear()
    monkeypatch.setitem(triton_chunk.LAUNCH["scan"], "OUTPUT_FROM", 2**30)  # the output kernel, not the fused scan
    with torch.no_grad():
        o, s = chunk_kda(q, k, v, g, beta, **kw)
    assert sorted(norm_calls) == [k.shape, q.shape]  # k in chunk_kda_triton, q in the pipeline's fallback
    assert_close("o (output kernel)", ro, o, 0.005)
    assert_close("ht (output kernel)", rs, s, 0.005)


def test_in_kernel_q_norm_has_no_backward():
    """The Function refuses q_eps when gradients are needed (chunk_kda_triton never passes it then)."""
    q, k, v, g, beta, h0 = raw_inputs(1, 20, 1, 1, 32, torch.float32)
    cfg = {"scale": 32**-0.5, "safe_shift": None, "chunk_size": 64, "cu_seqlens": None, "h_fp32": False,
           "lower_bound": None, "cu_host": None, "g_check": None, "q_eps": 1e-6, "grad": True}
    with pytest.raises(RuntimeError, match="q_eps .* has no backward"):
        triton_chunk._ChunkKDATriton.apply(q.requires_grad_(), k, v, g, beta, h0, cfg)
