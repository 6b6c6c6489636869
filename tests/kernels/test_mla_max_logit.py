"""The per-head max causal logit (k3kernels/mla causal_max_logit, QK-Clip's statistic): the Triton kernel
(interpreter on a CPU, the GPU in fp32 and bf16) and its PyTorch twin against a float64 reference that scores one
(query, key) pair at a time."""

import importlib.util

import pytest
import torch

from k3.kernels.mla import causal_max_logit_torch

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
HAS_TRITON = importlib.util.find_spec("triton") is not None

pytestmark = pytest.mark.usefixtures("triton_cpu")  # tests/kernels/conftest.py


def reference(q, k, scale, q_start):
    """float64: max over t, s <= q_start + t of scale * <q[b, t, h], k[b, s, h]>, per head, pair by pair."""
    B, T, H, _ = q.shape
    q, k = q.double().cpu(), k.double().cpu()
    out = torch.full((H,), float("-inf"), dtype=torch.float64)
    for h in range(H):
        for b in range(B):
            for t in range(T):
                keys = k[b, : q_start + t + 1, h]  # [s, E]
                out[h] = max(out[h], float((keys @ q[b, t, h]).max()) * scale)
    return out


def make(B, T, H, E, q_start, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, E, generator=gen)
    k = torch.randn(B, q_start + T, H, E, generator=gen)
    S = q_start + T
    if S >= 3:  # a large logit far below the diagonal (key 2 of the last query)
        q[1 % B, T - 1, 0] = 3 * k[1 % B, 2, 0]
    if T >= 2:  # a larger one in the future of query 0 (key q_start + 1): must not count
        k[0, q_start + 1, H - 1] = 5 * q[0, 0, H - 1]
    return q.to(DEV, dtype), k.to(DEV, dtype)


# T = 70 crosses a 64-row block; E = 24 pads to 32 (not a power of two); q_start > 0 is a chunk after a prefix
SHAPES = [(2, 70, 3, 24, 0), (1, 9, 2, 16, 5), (2, 1, 4, 40, 0)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_T{}_H{}_E{}_start{}".format(*s))
def test_twin_matches_reference(shape):
    B, T, H, E, start = shape
    q, k = make(B, T, H, E, start, torch.float32)
    ref = reference(q, k, 0.37, start)
    torch.testing.assert_close(causal_max_logit_torch(q, k, 0.37, start).double().cpu(), ref, rtol=1e-5, atol=1e-5)
    # float64 inputs are scored in float64
    out64 = causal_max_logit_torch(q.double(), k.double(), 0.37, start)
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64.cpu(), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if CUDA else [torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_T{}_H{}_E{}_start{}".format(*s))
def test_triton_matches_reference(shape, dtype):
    from k3.kernels.mla.triton_max_logit import causal_max_logit_triton

    B, T, H, E, start = shape
    q, k = make(B, T, H, E, start, dtype)
    out = causal_max_logit_triton(q, k, 0.37, start)
    assert out.dtype == torch.float32 and out.shape == (H,)
    # the reference scores the same (bf16-rounded) values in float64: only the fp32 accumulation differs
    torch.testing.assert_close(out.double().cpu(), reference(q, k, 0.37, start), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_ignores_future_keys_and_mixed_dtypes():
    from k3.kernels.mla.triton_max_logit import causal_max_logit_triton

    q = torch.zeros(1, 4, 1, 16, device=DEV)
    k = torch.zeros(1, 4, 1, 16, device=DEV)
    q[0, :, 0, 0] = 1.0
    k[0, :, 0, 0] = torch.tensor([1.0, 2.0, 3.0, 100.0])  # key 3 is seen by query 3 only
    assert float(causal_max_logit_triton(q, k, 0.5, 0)[0]) == 50.0
    q[0, 3] = 0.0  # the last query no longer scores it: the max is key 2 for query 2
    assert float(causal_max_logit_triton(q, k.to(torch.bfloat16), 0.5, 0)[0]) == 1.5


def test_dispatch_runs_the_chosen_backend(monkeypatch):
    from k3.kernels import dispatch, mla

    calls = []
    monkeypatch.setattr(mla, "causal_max_logit_torch", lambda *a: calls.append("torch") or torch.zeros(1))
    monkeypatch.setenv("K3_KERNELS", "torch")
    dispatch.kernel_backend.cache_clear()
    q = torch.randn(1, 3, 1, 16)
    mla.causal_max_logit(q, q, 1.0)
    assert calls == ["torch"]
