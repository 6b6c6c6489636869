"""The fused int4 dequant GEMMs (k3kernels/quant/triton.py) against their twins and a float64 reference written here.

On a CPU they run under Triton's interpreter (tests/kernels/conftest.py) at small sizes, in fp32; on a GPU also in
bf16. Outputs come from torch.empty (NaN-poisoned by conftest), so a row the kernel skips fails the comparison.
The grouped cases cover empty experts, a first and a last expert without rows, rows past one tile, and the large
row tile (more than 16 rows per expert on average).
"""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

from k3.kernels.quant import (
    fake_quant_fp8_per_token,
    pack_int4,
    quant_grouped_mm,
    quant_grouped_mm_torch,
    quant_linear,
    quant_linear_torch,
    quantize_int4_grouped,
)
from k3.kernels.quant.triton import DECODE, PREFILL, Launch, w4_grouped_mm_triton, w4_linear_triton
from k3.kernels.testing import assert_close

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# fp16 on the CPU: the interpreter has no bfloat16, and 16-bit x takes the kernel's bit-built codes (magic numbers)
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.float16]

pytestmark = pytest.mark.usefixtures("triton_cpu", "masks_are_bool")


def ratio_for(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2 if dtype == torch.bfloat16 else 2e-3


def ref_dequant(packed, scales):
    """uint8 [.., N, K/2] + scales [.., N, G] -> float64 [.., N, K] by arithmetic (low nibble = even index)."""
    v = packed.to(torch.int64).cpu()
    lo, hi = v % 16, v // 16
    q = torch.stack([torch.where(lo >= 8, lo - 16, lo), torch.where(hi >= 8, hi - 16, hi)], -1).flatten(-2).double()
    G = scales.shape[-1]
    return (q.reshape(*q.shape[:-1], G, -1) * scales.double().cpu()[..., None]).reshape(q.shape)


def ref_grouped(x, w_EOI, counts):
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        out.append(x[start:start + c].double().cpu() @ w_EOI[e].T)
        start += c
    return torch.cat(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("counts", "N", "K", "group"), [
    ([5, 0, 9, 3], 48, 64, 32),
    ([0, 1, 17, 0], 40, 48, 16),  # K not a multiple of the 128-wide K step; 17 rows: two row tiles
    ([2, 3], 64, 256, 128),
    ([40, 33, 0], 24, 32, 16),  # 73 rows over 3 experts: the 64-row tile
], ids=["mixed", "k48-g16", "g128", "large-tile"])
def test_grouped_matches_twin_and_float64(counts, N, K, group, dtype):
    counts = torch.tensor(counts, device=DEV)
    E = counts.numel()
    x = torch.randn(int(counts.sum()), K).to(DEV, dtype)
    qw, s = quantize_int4_grouped(torch.randn(E, N, K, device=DEV), group)
    y = w4_grouped_mm_triton(x, qw, s, counts)
    assert y.dtype == dtype and y.shape == (x.shape[0], N)
    assert_close("grouped vs float64", ref_grouped(x, ref_dequant(qw, s), counts.cpu()), y, ratio_for(dtype))
    assert_close("grouped vs twin", quant_grouped_mm_torch(x, qw, s, counts, "w4a16"), y, ratio_for(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("lead", "N", "K", "group"), [((3, 7), 40, 64, 32), ((70,), 24, 48, 16), ((1,), 64, 128, 64)],
                         ids=["3x7", "70-rows", "one-row"])
def test_dense_matches_twin_and_float64(lead, N, K, group, dtype):
    x = torch.randn(*lead, K).to(DEV, dtype)
    qw, s = quantize_int4_grouped(torch.randn(N, K, device=DEV), group)
    y = w4_linear_triton(x, qw, s)
    assert y.dtype == dtype and y.shape == (*lead, N)
    assert_close("dense vs float64", x.double().cpu() @ ref_dequant(qw, s).T, y, ratio_for(dtype))
    assert_close("dense vs twin", quant_linear_torch(x, qw, s, "w4a16"), y, ratio_for(dtype))


# every shape of launch the table or benchmarks/quant_tune.py can pick: both operand orders, K steps of one or
# several groups (with a tail step), row tiles of 16 and 32
CONFIGS = [DECODE, PREFILL, Launch(True, 32, 32, 2, 4, 1), Launch(False, 16, 32, 3, 4, 2),
           Launch(False, 32, 64, 1, 2, 1)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"swap{int(c.swap)}-m{c.block_m}-n{c.block_n}-s{c.steps}")
@pytest.mark.parametrize("a8", [False, True], ids=["w4a16", "w4a8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_launch_matches_the_twin(config, a8, dtype):
    """Any Launch, with and without w4a8's FP8 activations, equals the twin of its format (w4a8: the twin
    quantizes x with fake_quant_fp8_per_token first) and a float64 reference."""
    counts = torch.tensor([3, 0, 21, 1], device=DEV)
    x = (torch.randn(int(counts.sum()), 160, device=DEV) * torch.logspace(-2, 1, 160, device=DEV)).to(dtype)
    qw, s = quantize_int4_grouped(torch.randn(4, 40, 160, device=DEV), 32)
    fmt = "w4a8" if a8 else "w4a16"
    y = w4_grouped_mm_triton(x, qw, s, counts, a8=a8, config=config)
    xa = fake_quant_fp8_per_token(x) if a8 else x
    assert_close(f"{fmt} grouped vs float64", ref_grouped(xa, ref_dequant(qw, s), counts.cpu()), y, ratio_for(dtype))
    assert_close(f"{fmt} grouped", quant_grouped_mm_torch(x, qw, s, counts, fmt), y, ratio_for(dtype))
    yd = w4_linear_triton(x[:5], qw[2], s[2], a8=a8, config=config)
    assert_close(f"{fmt} dense", quant_linear_torch(x[:5], qw[2], s[2], fmt), yd, ratio_for(dtype))


def test_in_kernel_fp8_activations_are_the_fake_quantizer_bit_for_bit():
    """Through an identity weight (code 1 on the diagonal, scale 1), y is the kernel's FP8 activation itself: it
    must equal fake_quant_fp8_per_token exactly, over ties between e4m3 neighbours, subnormals (below 2**-6 of
    the row's scale), the row maximum (448) and zero rows."""
    K = 32
    q = torch.eye(K, dtype=torch.int8)
    qw, s = pack_int4(q).to(DEV), torch.ones(K, 1, device=DEV)
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # the positive codes
    mids = (e4m3[1:] + e4m3[:-1]) / 2  # exact ties: round half to even
    vals = torch.cat([e4m3, mids, mids * (1 + 2**-20), mids * (1 - 2**-20)])
    v = torch.cat([vals, -vals])
    v = torch.cat([v, torch.zeros(-len(v) % (K - 1))]).view(-1, K - 1)
    rows = torch.cat([v, torch.full((len(v), 1), 448.0)], 1)  # each row's scale is exactly 1
    x = torch.cat([rows, torch.zeros(1, K), torch.randn(4, K) * 1e-3]).to(DEV)
    y = w4_linear_triton(x, qw, s, a8=True)
    ref = fake_quant_fp8_per_token(x)
    assert torch.equal(y, ref), (y - ref).abs().max()


@pytest.mark.parametrize("fmt", ["w4a8", "w4a16", "w8a16"])
def test_public_ops_dispatch_on_the_triton_backend(kernel_env, launch_spy, fmt):
    """K3_KERNELS=triton: the int4 formats launch the fused kernel (w4a8 with its FP8 activations inside) and equal the
    twin; w8a16 and float64 stay on the twin; the torch backend never launches it."""
    from k3.kernels.quant import quantize_weight
    from k3.kernels.quant import triton as qt

    kernel_env(K3_KERNELS="triton")
    grids = launch_spy(qt, "_w4_gemm_kernel")
    counts = torch.tensor([3, 0, 6], device=DEV)
    x = torch.randn(9, 64, device=DEV)
    qw, s = quantize_weight(torch.randn(3, 32, 64, device=DEV), fmt, 32)
    assert_close(f"{fmt} grouped", quant_grouped_mm_torch(x, qw, s, counts, fmt),
                 quant_grouped_mm(x, qw, s, counts, fmt), 1e-5)
    assert_close(f"{fmt} dense", quant_linear_torch(x, qw[0], s[0], fmt), quant_linear(x, qw[0], s[0], fmt), 1e-5)
    assert len(grids) == (2 if fmt != "w8a16" else 0)
    quant_grouped_mm(x.double(), qw, s, counts, fmt)
    assert len(grids) == (2 if fmt != "w8a16" else 0)  # float64 runs the twin
    kernel_env(K3_KERNELS="torch")
    quant_linear(x, qw[0], s[0], fmt)
    assert len(grids) == (2 if fmt != "w8a16" else 0)


def test_argument_checks():
    qw, s = quantize_int4_grouped(torch.randn(2, 16, 64, device=DEV), 32)
    with pytest.raises(ValueError, match="disagree"):
        w4_grouped_mm_triton(torch.randn(3, 32, device=DEV), qw, s, torch.tensor([1, 2], device=DEV))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        w4_linear_triton(torch.randn(3, 64, device=DEV).double(), qw[0], s[0])
    with pytest.raises(ValueError, match="counts"):
        w4_grouped_mm_triton(torch.randn(3, 64, device=DEV), qw, s, torch.tensor([3], device=DEV))
    assert w4_grouped_mm_triton(torch.randn(0, 64, device=DEV), qw, s, torch.zeros(2, dtype=torch.long,
                                                                                    device=DEV)).shape == (0, 16)
