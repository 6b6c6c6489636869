"""The KDA gate as Triton kernels (k3kernels/kda/triton/gate.py) against its PyTorch twins in float64 (kda.md section
2): g, and the gradients of z, A_log and dt_bias, for the lower-bound gate (with and without A_log / dt_bias) and the
softplus gate (including inputs above softplus's threshold of 20). On a CPU under Triton's interpreter; on a CUDA
machine on the GPU. Outputs come from torch.empty, which conftest NaN-poisons: an unwritten element fails.
"""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

# after the skip; conftest imported the kernel modules under the interpreter on a CPU
from k3.kernels.kda import chunk_kda, naive_kda_gate, naive_kda_lowerbound_gate
from k3.kernels.kda.triton import gate as gate_mod
from k3.kernels.kda.triton.gate import kda_gate_triton
from k3.kernels.testing import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("triton_cpu")  # tests/kernels/conftest.py

CASES = [  # (B, T, HV, K, lower_bound, with A_log, with dt_bias)
    (1, 70, 2, 32, -5.0, True, True),  # T past one 64-token block
    (2, 9, 1, 60, -2.0, False, True),  # K padded (60 -> 64), no A_log
    (1, 33, 3, 16, -5.0, True, False),  # no dt_bias
    (1, 65, 2, 32, None, True, True),  # softplus gate
    (1, 5, 1, 32, None, True, False),
]


def _inputs(B, T, HV, K, with_a, with_b, dtype):
    torch.manual_seed(0)
    z = 4.0 * torch.randn(B, T, HV, K)
    z[0, 0, 0, :4] = torch.tensor([25.0, 21.0, 19.0, -30.0])  # around softplus's threshold and far below
    A_log = torch.randn(HV) if with_a else None
    dt_bias = torch.randn(HV * K) if with_b else None
    return z.to(DEV, dtype), A_log, dt_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,HV,K,lb,with_a,with_b", CASES,
                         ids=[f"B{c[0]}-T{c[1]}-HV{c[2]}-K{c[3]}-{'lb' if c[4] else 'softplus'}"
                              f"{'-A' if c[5] else ''}{'-bias' if c[6] else ''}" for c in CASES])
def test_gate_matches_the_torch_twin_forward_and_backward(B, T, HV, K, lb, with_a, with_b, dtype):
    z, A_log, dt_bias = _inputs(B, T, HV, K, with_a, with_b, dtype)
    dg = torch.randn(B, T, HV, K)

    def run(fn, zz, a, b, device):
        leaves = [x.detach().to(device).requires_grad_() if x is not None else None for x in (zz, a, b)]
        g = fn(*leaves)
        grads = torch.autograd.grad(g, [x for x in leaves if x is not None], dg.to(device, g.dtype))
        return [g, *grads]

    def twin(zz, a, b):
        return naive_kda_lowerbound_gate(zz, a, b, lb) if lb is not None else naive_kda_gate(zz, a, b)

    ref = run(twin, z.double().cpu(), *(x.double() if x is not None else None for x in (A_log, dt_bias)), "cpu")
    out = run(lambda zz, a, b: kda_gate_triton(zz, a, b, lb),
              z, *(x.to(DEV) if x is not None else None for x in (A_log, dt_bias)), DEV)
    assert out[0].dtype == torch.float32 and out[1].dtype == dtype
    names = ["g", "dz"] + (["dA_log"] if with_a else []) + (["d dt_bias"] if with_b else [])
    ratio = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: dz is stored in z's dtype
    for name, r, x in zip(names, ref, out, strict=True):
        assert_close(name, r, x.cpu(), 1e-5 if name == "g" else ratio)


def test_gate_checks_its_arguments():
    z = torch.randn(1, 3, 1, 16, device=DEV)
    with pytest.raises(ValueError, match=r"lower_bound must lie in \[-5, 0\)"):
        kda_gate_triton(z, None, None, -6.0)
    with pytest.raises(ValueError, match="softplus gate needs A_log"):
        kda_gate_triton(z, None, None, None)


def test_chunk_kda_in_kernel_gate_runs_the_triton_gate(monkeypatch, kernel_env):
    """chunk_kda(use_gate_in_kernel=True) on the Triton backend computes g with kda_gate_triton: the same outputs and
    gradients as g computed by the twin and passed in."""
    kernel_env(K3_KERNELS="triton")
    calls = []
    real = gate_mod.kda_gate_triton
    monkeypatch.setattr(gate_mod, "kda_gate_triton", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(1)
    B, T, H, K = 1, 40, 1, 32
    q, k, v = (torch.rand(B, T, H, K, device=DEV) for _ in range(3))
    z = torch.randn(B, T, H, K, device=DEV)
    beta = torch.rand(B, T, H, device=DEV)
    A_log, dt_bias = torch.randn(H, device=DEV), torch.randn(H * K, device=DEV)
    outs = []
    for fused in (True, False):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, z, A_log, dt_bias)]
        gz = leaves[3] if fused else naive_kda_lowerbound_gate(leaves[3], leaves[4], leaves[5], -5.0)
        kw = {"A_log": leaves[4], "dt_bias": leaves[5]} if fused else {}
        o, _ = chunk_kda(*leaves[:3], gz, beta, use_gate_in_kernel=fused, lower_bound=-5.0, safe_gate=True,
                         use_qk_l2norm_in_kernel=True, output_final_state=True, **kw)
        outs.append([o, *torch.autograd.grad(o.square().sum(), leaves)])
    assert calls == [1]
    for name, a, b in zip(["o", "dq", "dk", "dv", "dz", "dA_log", "d dt_bias"], *outs, strict=True):
        assert_close(name, a, b, 1e-5)
