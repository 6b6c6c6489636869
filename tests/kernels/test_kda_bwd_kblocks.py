"""The Triton backward's inter-chunk kernel with its K loop split into blocks (launch.LAUNCH["bwd_inter"]
["BK"] below next_pow2(K)) gives the gradients of the one-pass kernel, which test_kda_triton.py checks against the
float64 recurrence. Both runs use the same Triton forward, so any difference is the split's: fp32 summation order
only, hence the tight tolerance. On a CPU under Triton's interpreter (tiny shapes), on a GPU natively.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

# after the skip; conftest imported the kernel modules under the interpreter on a CPU
from k3.kernels.kda import chunk_kda, l2norm
from k3.kernels.kda.triton import chunk_bwd as bwd_mod
from k3.kernels.kda.triton import launch as launch_mod

DEV = "cuda" if torch.cuda.is_available() else "cpu"


pytestmark = pytest.mark.usefixtures("triton_kda_backward")  # tests/kernels/conftest.py


def _grads(monkeypatch, bk, *, T, HV, D, BT, safe, cu=None):
    """o, final state and every input gradient with the inter kernel's K block `bk`."""
    monkeypatch.setitem(launch_mod.LAUNCH["bwd_inter"], "BK", bk)
    torch.manual_seed(0)
    N = 1 if cu is None else len(cu) - 1
    xs = [l2norm(torch.rand(1, T, 1, D)), l2norm(torch.rand(1, T, 1, D)), torch.rand(1, T, HV, D),
          F.logsigmoid(torch.randn(1, T, HV, D)), torch.randn(1, T, HV).sigmoid(), torch.randn(N, HV, D, D)]
    leaves = [x.to(DEV).requires_grad_() for x in xs]
    o, s = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=BT, safe_gate=safe,
                     lower_bound=-5.0 if safe else None,
                     cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV))
    torch.manual_seed(1)
    loss = (o * torch.randn(o.shape).to(DEV)).sum() + (s * torch.randn(s.shape).to(DEV)).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("D,bk,BT,safe,cu", [
    (32, 16, 64, True, None),  # 2 K blocks
    (60, 16, 32, False, None),  # 4 K blocks, the last one masked (keys 48..59), exact diagonal path
    (32, 16, 64, True, [0, 23, 23, 70]),  # varlen with an empty sequence
], ids=["D32-bk16", "D60-bk16-exact", "varlen"])
def test_bwd_inter_k_blocks_equal_one_pass(monkeypatch, D, bk, BT, safe, cu, kernel_env):
    # IEEE dots: tf32x3 (the fp32 default) keeps K blocks >= 32 (launch.inter_k_block)
    kernel_env(K3_KDA_FP32_DOTS="ieee")
    T = 70 if cu is not None else 45
    one = _grads(monkeypatch, 256, T=T, HV=2, D=D, BT=BT, safe=safe, cu=cu)
    split = _grads(monkeypatch, bk, T=T, HV=2, D=D, BT=BT, safe=safe, cu=cu)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), one, split, strict=True):
        assert torch.isfinite(b).all(), name
        err = ((a - b).norm() / a.norm().clamp_min(1e-12)).item()
        assert err < 1e-5, f"{name}: relative error {err:.2e} between the one-pass and the K-block inter kernel"


def test_half_partials(monkeypatch):
    """LAUNCH["bwd_inter"]["HALF_PARTIALS"]: the inter kernel's partial dq / dk stored in the inputs' half dtype. To
    run the half buffers with fp32 inputs (the interpreter cannot run bf16 ones), partial_dtype is patched to bf16:
    dv, dg, dbeta and dh0 never read the partials, so they stay bit-identical under the interpreter (on a GPU the
    inter kernel with a bf16 store is another compilation, whose fp32 products may round in another order: the
    H200 gave a dg that differed, so there within 1e-6 relative); dq and dk carry one bf16 rounding of their
    inter-chunk part, so they differ, but by less than bf16's unit roundoff relative to their size."""
    assert launch_mod.partial_dtype(torch.bfloat16) == torch.bfloat16  # on by default
    monkeypatch.setitem(launch_mod.LAUNCH["bwd_inter"], "HALF_PARTIALS", False)
    assert launch_mod.partial_dtype(torch.bfloat16) == torch.float32
    full = _grads(monkeypatch, 64, T=70, HV=2, D=32, BT=64, safe=True)
    monkeypatch.setitem(launch_mod.LAUNCH["bwd_inter"], "HALF_PARTIALS", True)
    assert launch_mod.partial_dtype(torch.bfloat16) == torch.bfloat16
    assert launch_mod.partial_dtype(torch.float16) == torch.float16
    assert launch_mod.partial_dtype(torch.float32) == torch.float32
    monkeypatch.setattr(bwd_mod, "partial_dtype", lambda dt: torch.bfloat16)  # where the backward looks it up
    half = _grads(monkeypatch, 64, T=70, HV=2, D=32, BT=64, safe=True)
    for name, a, b in zip(("dv", "dg", "dbeta", "dh0"), full[2:], half[2:], strict=True):
        if DEV == "cpu":
            assert torch.equal(a, b), f"{name} changed with half partials"
        else:
            err = ((a - b).norm() / a.norm()).item()
            assert err < 1e-6, f"{name}: relative change {err:.2e} with half partials (expected fp32 reordering)"
    for name, a, b in zip(("dq", "dk"), full[:2], half[:2], strict=True):
        err = ((a - b).norm() / a.norm()).item()
        assert 0 < err < 2 ** -8, f"{name}: relative change {err:.2e} with bf16 partials (expected one rounding)"


def test_inter_k_block_floor_for_tf32x3(monkeypatch):
    """tf32x3 dots take K blocks of at least 32 (an illegal address at 16 on the H200), within the padded K."""
    monkeypatch.setitem(launch_mod.LAUNCH["bwd_inter"], "BK", 16)
    assert [launch_mod.inter_k_block(bk, "tf32x3") for bk in (16, 32, 128)] == [16, 32, 32]
    assert [launch_mod.inter_k_block(bk, p) for bk in (32, 128) for p in ("ieee", "tf32", "bf16")] == [16] * 6
    monkeypatch.setitem(launch_mod.LAUNCH["bwd_inter"], "BK", 64)
    assert [launch_mod.inter_k_block(bk, "tf32x3") for bk in (32, 128)] == [32, 64]


@pytest.fixture(scope="module")
def late_loads():
    """late_loads(monkeypatch, D, bk): _grads at T = 70 with EARLY_LOADS 0, run once a module for each D and bk (the
    reference of both EARLY_LOADS values; deterministic, so the same gradients each time)."""
    refs = {}

    def get(monkeypatch, D, bk):
        if (D, bk) not in refs:
            monkeypatch.setitem(launch_mod.LAUNCH["bwd_inter"], "EARLY_LOADS", 0)
            refs[D, bk] = _grads(monkeypatch, bk, T=70, HV=2, D=D, BT=64, safe=True)
        return refs[D, bk]

    return get


@pytest.mark.parametrize("early", [1, 2])
@pytest.mark.parametrize("D,bk", [(32, 64), (60, 16)], ids=["one-block", "K-blocks"])
def test_bwd_inter_early_loads(monkeypatch, D, bk, early, kernel_env, late_loads):
    """LAUNCH["bwd_inter"]["EARLY_LOADS"] 1 and 2 (as shipped) against 0: the inter kernel issues loads sooner (1:
    each K block's Gamma, k and q before its V loop instead of after it; 2: also v and Akk). The same loads and
    arithmetic in another order, so the same gradients (bitwise under the interpreter, which runs the kernel as
    written; on a GPU within fp32 reordering)."""
    kernel_env(K3_KDA_FP32_DOTS="ieee")
    late = late_loads(monkeypatch, D, bk)
    monkeypatch.setitem(launch_mod.LAUNCH["bwd_inter"], "EARLY_LOADS", early)
    early = _grads(monkeypatch, bk, T=70, HV=2, D=D, BT=64, safe=True)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), late, early, strict=True):
        if DEV == "cpu":
            assert torch.equal(a, b), f"{name} changed with EARLY_LOADS {early}"
        else:
            err = ((a - b).norm() / a.norm().clamp_min(1e-12)).item()
            assert err < 1e-6, f"{name}: relative change {err:.2e} with EARLY_LOADS {early}"
