"""The q / k L2 norm of `chunk_kda(..., use_qk_l2norm_in_kernel=True)` inside the forward's intra kernel (its NORM:
every row it loads normalized as triton_l2norm.l2norm_fwd computes and stores it; rstd stored for the backward; the
normalized rows stored only when a later kernel or the backward reads them, else the w/u kernel scales k's rows
itself) against the separate pass it replaces: chunk_kda on l2norm_fwd's rows with the in-kernel norm off.

The same operands reach every dot either way, so the outputs and final states are equal: bitwise under the CPU
interpreter, within fp32 reordering of the row sums on a GPU. Three forwards: inference with the output fused into
the scan (no normalized rows stored), inference with the output kernel (they are stored: it reads q), and a training
forward (stored: the backward reads them). Buffers come from torch.empty, NaN-poisoned by tests/conftest.py, so a
row the kernel fails to normalize or store (a value head that is not the first of its q / k head, a partial chunk,
an empty sequence) fails the comparison. The gradients through the norm are checked against the float64 recurrence
by test_kda_triton.py's qk_l2norm tests.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

# after the skip; conftest imported the kernel modules under the interpreter on a CPU
from k3.kernels.kda import chunk_kda, triton_l2norm
from k3.kernels.kda import triton_chunk as fwd

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NEVER = 1 << 30

pytestmark = pytest.mark.usefixtures("triton_kda_backward")  # tests/kernels/conftest.py

CASES = [  # (T, H, HV, K, V, chunk_size, safe_gate, cu_seqlens)
    (70, 1, 1, 32, 32, 64, True, None),  # a partial chunk
    (45, 1, 2, 100, 60, 32, False, None),  # K and V masked (next_pow2 128 / 64), exact gate
    (50, 2, 4, 32, 32, 32, True, None),  # GVA: 2 value heads per q/k head, one of which stores
    (80, 1, 2, 32, 32, 64, True, [0, 15, 15, 80]),  # varlen with an empty sequence
]
MODES = ["inference-fused", "inference-output-kernel", "training"]


def _inputs(T, H, HV, K, V, N):
    torch.manual_seed(0)
    q, k = 3 * torch.rand(1, T, H, K) - 1, 2 * torch.rand(1, T, H, K)  # raw rows of norm far from 1
    v, g = torch.rand(1, T, HV, V), F.logsigmoid(torch.randn(1, T, HV, K)).clamp_min(-5.0)
    beta, h0 = torch.randn(1, T, HV).sigmoid(), torch.randn(N, HV, K, V)
    return [x.to(DEV) for x in (q, k, v, g, beta, h0)]


def _forward(xs, *, norm, BT, safe, cu, grad):
    leaves = [x.detach().clone().requires_grad_(grad) for x in xs]
    o, s = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=BT, safe_gate=safe,
                     lower_bound=-5.0 if safe else None, use_qk_l2norm_in_kernel=norm,
                     cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV))
    return o.detach(), s.detach()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T,H,HV,K,V,BT,safe,cu", CASES, ids=["partial", "masked-exact", "gva", "varlen"])
def test_norm_in_the_intra_kernel_matches_the_separate_pass(T, H, HV, K, V, BT, safe, cu, mode, monkeypatch,
                                                            launch_spy):
    monkeypatch.setitem(fwd.LAUNCH["scan"], "OUTPUT_FROM", NEVER if mode == "inference-output-kernel" else 0)
    xs = _inputs(T, H, HV, K, V, 1 if cu is None else len(cu) - 1)
    qn, kn = (triton_l2norm.l2norm_fwd(x)[0] for x in xs[:2])
    ref = _forward([qn, kn, *xs[2:]], norm=False, BT=BT, safe=safe, cu=cu, grad=mode == "training")
    passes = launch_spy(triton_l2norm, "_l2norm_fwd_kernel")
    out = _forward(xs, norm=True, BT=BT, safe=safe, cu=cu, grad=mode == "training")
    assert passes == [], "the q / k L2 norm ran a pass of its own"
    for name, r, x in zip(("o", "final state"), ref, out, strict=True):
        assert torch.isfinite(x).all(), f"{name}: not finite (a row not normalized or not stored)"
        if DEV == "cpu":
            assert torch.equal(r, x), f"{name} differs from the separate pass's"
        else:
            err = ((r - x).norm() / r.norm().clamp_min(1e-12)).item()
            assert err < 1e-6, f"{name}: relative change {err:.2e} against the separate pass"


def test_training_forward_keeps_the_normalized_rows_and_rstd(monkeypatch):
    """chunk_fwd_pipeline(l2norm=True, keep_qk=True): "qk" holds l2norm_fwd's rows and "rstd" its rstd (what the
    backward reads); without keep_qk and with the output fused, neither row tensor is written."""
    xs = _inputs(70, 2, 4, 32, 32, 1)
    q, k, v, g, beta, h0 = xs
    kw = {"scale": 32**-0.5, "safe_shift": 15 * 5.0 / 2, "chunk_size": 64, "cu_seqlens": None, "h_fp32": False,
          "l2norm": True}
    monkeypatch.setitem(fwd.LAUNCH["scan"], "OUTPUT_FROM", 0)
    r = fwd.chunk_fwd_pipeline(q, k, v, g, beta, h0, store_akk=True, keep_qk=True, **kw)
    for x, y, ry in zip((q, k), r["qk"], r["rstd"], strict=True):
        want, rstd = triton_l2norm.l2norm_fwd(x)
        assert y.shape == x.shape and ry.shape == rstd.shape
        if DEV == "cpu":
            assert torch.equal(y, want) and torch.equal(ry, rstd)
        else:
            torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(ry, rstd, rtol=1e-6, atol=0)
    r = fwd.chunk_fwd_pipeline(q, k, v, g, beta, h0, **kw)
    assert r["qk"] is None and r["rstd"] is not None
