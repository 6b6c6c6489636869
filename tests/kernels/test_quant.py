"""k3.kernels.quant against float64 references written here: int4 packing, group / channel RTN quantization,
per-token FP8 activation fake-quant, quant_grouped_mm against a per-expert float64 loop, and the entry points on
CPU tensors under the triton backend of a GPU host (the twins)."""

import importlib.util

import pytest
import torch

from k3.kernels.quant import (
    dequantize_int4_grouped,
    dequantize_int8_channel,
    fake_quant_fp8_per_token,
    pack_int4,
    quant_grouped_mm,
    quant_grouped_mm_torch,
    quant_linear,
    quant_linear_torch,
    quantize_int4_grouped,
    quantize_int8_channel,
    quantize_weight,
    unpack_int4,
)
from k3.kernels.testing import assert_close


def ref_unpack(p: torch.Tensor) -> torch.Tensor:
    """Bytes -> signed nibbles, by arithmetic: low nibble first, v >= 8 means v - 16 (two's complement)."""
    v = p.to(torch.int64)
    lo, hi = v % 16, v // 16
    lo, hi = torch.where(lo >= 8, lo - 16, lo), torch.where(hi >= 8, hi - 16, hi)
    return torch.stack([lo, hi], -1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def ref_dequant_groups(packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    q = ref_unpack(packed).double()
    return (q.reshape(*q.shape[:-1], -1, group) * scales.double()[..., None]).reshape(q.shape)


def ref_fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """float64: s = absmax(row) / 448, e4m3 rounding through torch's cast, back times s; zero rows stay zero."""
    x = x.double()
    s = x.abs().amax(-1, keepdim=True) / 448.0
    s1 = torch.where(s == 0, torch.ones_like(s), s)
    return (x / s1).to(torch.float8_e4m3fn).double() * s1


def test_pack_unpack_all_pairs():
    vals = torch.arange(-8, 8)
    pairs = torch.cartesian_prod(vals, vals)  # [256, 2]: every (even, odd) combination
    packed = pack_int4(pairs.to(torch.int8))
    assert packed.dtype == torch.uint8 and packed.shape == (256, 1)
    expect = (pairs[:, 0] % 16) + 16 * (pairs[:, 1] % 16)  # low nibble = even index
    assert torch.equal(packed[:, 0].long(), expect)
    assert torch.equal(unpack_int4(packed).long(), pairs)
    assert torch.equal(ref_unpack(packed), pairs)
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 2, 32)
    assert torch.equal(pack_int4(unpack_int4(every_byte)), every_byte)  # the other direction, odd leading shape


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="even last dimension"):
        pack_int4(torch.zeros(3, 5, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([3, 8]))
    with pytest.raises(ValueError, match="integer tensor"):
        pack_int4(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="uint8"):
        unpack_int4(torch.zeros(2, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match="divide"):
        quantize_int4_grouped(torch.randn(2, 3, 48), 32)


@pytest.mark.parametrize("group", [16, 32])
def test_int4_group_rtn_error_bound(group):
    w = torch.randn(3, 5, 64) * torch.logspace(-3, 1, 5)[None, :, None]  # rows of very different magnitude
    w[0, 0, :group] = 0.0  # an all-zero group
    packed, s = quantize_int4_grouped(w, group)
    assert packed.shape == (3, 5, 32) and s.shape == (3, 5, 64 // group) and s.dtype == torch.float32
    s_ref = w.double().reshape(3, 5, -1, group).abs().amax(-1) / 7
    assert torch.allclose(s.double(), s_ref, rtol=1e-6, atol=0)
    assert ref_unpack(packed).abs().max() <= 7  # RTN never needs -8
    w_ref = ref_dequant_groups(packed, s, group)
    err = (w.double() - w_ref).abs().reshape(3, 5, -1, group)
    assert (err <= s.double()[..., None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(w_ref[0, 0, :group], torch.zeros(group, dtype=torch.float64))
    assert torch.equal(dequantize_int4_grouped(packed, s), w_ref.float())  # fp32 product rounds once
    assert torch.equal(dequantize_int4_grouped(packed, s, torch.float64), w_ref)
    # the error is the rounding error, not worse: about a quarter of the step on average for uniform rounding
    assert (err / s.double()[..., None].clamp_min(1e-30)).mean() < 0.3


def test_int8_channel_rtn_error_bound():
    w = torch.randn(2, 6, 40) * torch.logspace(-2, 2, 6)[None, :, None]
    w[1, 2] = 0.0
    q, s = quantize_int8_channel(w)
    assert q.dtype == torch.int8 and s.shape == (2, 6, 1) and q.abs().max() <= 127
    assert torch.allclose(s.double(), w.double().abs().amax(-1, keepdim=True) / 127, rtol=1e-6, atol=0)
    w_ref = q.double() * s.double()
    assert ((w.double() - w_ref).abs() <= s.double() / 2 * (1 + 1e-6)).all()
    assert torch.equal(w_ref[1, 2], torch.zeros(40, dtype=torch.float64))
    assert torch.equal(dequantize_int8_channel(q, s), w_ref.float())
    with pytest.raises(ValueError, match="scales"):
        dequantize_int8_channel(q, s[..., 0])


def test_fp8_per_token_fake_quant():
    x = torch.randn(7, 48) * torch.logspace(-4, 3, 7)[:, None]
    x[3] = 0.0
    x[5, 0] = -1e5  # one large outlier: the rest of the row is coarse
    ref = ref_fake_fp8(x)
    out = fake_quant_fp8_per_token(x)
    assert out.dtype == torch.float32 and torch.equal(out[3], torch.zeros(48))
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=0)
    assert torch.equal(fake_quant_fp8_per_token(x.double()), ref)
    amax = x.abs().amax(-1)
    assert torch.allclose(out.abs().amax(-1), amax, rtol=1e-6)  # the row maximum maps to +-448 exactly
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 on elements in the normal range
    big = x.abs() >= amax[:, None] * 2.0 ** -6
    rel = ((out - x).abs() / x.abs().clamp_min(1e-30))[big]
    assert rel.max() <= 2.0 ** -4 * (1 + 1e-6) and rel.max() > 0
    xb = x.bfloat16()
    assert fake_quant_fp8_per_token(xb).dtype == torch.bfloat16
    assert torch.allclose(fake_quant_fp8_per_token(xb).double(), ref_fake_fp8(xb), rtol=1e-2, atol=0)


def _ref_grouped(x, w_EOI, counts, act_quant):
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        xe = x[start:start + c].double()
        out.append((ref_fake_fp8(xe) if act_quant else xe) @ w_EOI[e].T)
        start += c
    return torch.cat(out)


@pytest.mark.parametrize("fmt", ["w4a8", "w8a16"])
@pytest.mark.parametrize("impl", ["auto", "loop"])
def test_quant_grouped_mm_matches_float64_loop(fmt, impl):
    E, O, I = 4, 48, 64
    counts = torch.tensor([5, 0, 9, 3])
    x = torch.randn(int(counts.sum()), I)
    w = torch.randn(E, O, I) / 8
    if fmt == "w4a8":
        qw, s = quantize_int4_grouped(w, 32)
        w_ref = ref_dequant_groups(qw, s, 32)
    else:
        qw, s = quantize_int8_channel(w)
        w_ref = qw.double() * s.double()
    ref = _ref_grouped(x, w_ref, counts, fmt == "w4a8")
    assert_close(f"{fmt} fp32", ref, quant_grouped_mm(x, qw, s, counts, fmt, impl=impl), 1e-5)
    out_bf16 = quant_grouped_mm(x.bfloat16(), qw, s, counts, fmt, impl=impl)
    assert out_bf16.dtype == torch.bfloat16
    # bf16 rounding of x can move an element across an fp8 rounding boundary: compare on the rounded x
    assert_close(f"{fmt} bf16", _ref_grouped(x.bfloat16(), w_ref, counts, fmt == "w4a8"), out_bf16, 1e-2)
    # against the unquantized weights the error is the quantization error: RTN rounding is ~uniform on
    # [-s/2, s/2], rms s / sqrt(12), relative to a Gaussian weight's std: int4 group 32 (s ~ 2.1 std / 7) ~0.09,
    # plus ~0.02 from the FP8 activations; int8 per row of 64 (s ~ 2.4 std / 127) ~0.006
    exact = _ref_grouped(x, w.double(), counts, False)
    rel = ((ref - exact).norm() / exact.norm()).item()
    assert 0 < rel < (0.15 if fmt == "w4a8" else 0.01)
    with pytest.raises(ValueError, match="unknown quantization format"):
        quant_grouped_mm(x, qw, s, counts, "nf4")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the triton backend needs the `triton` package")
@pytest.mark.parametrize("fmt", ["w4a8", "w4a16", "w8a16"])
def test_triton_backend_of_a_gpu_host_runs_the_twins_on_cpu_tensors(monkeypatch, kernel_env, fmt):
    """K3_KERNELS=triton (or auto) where a GPU is present, without the interpreter: a CPU model (a reference, an
    export) calls the entry points with CPU tensors, which a Triton kernel cannot read; they run the twins instead,
    bit for bit, in fp32 and bf16."""
    from k3.kernels import dispatch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the backend choice of a GPU host
    kernel_env(K3_KERNELS="triton", TRITON_INTERPRET=None)
    assert dispatch.kernel_backend() == "triton"
    E, O, I = 3, 40, 64
    counts = torch.tensor([4, 0, 5])
    qw, s = quantize_weight(torch.randn(E, O, I) / 8, fmt, 32)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(int(counts.sum()), I, dtype=dtype)
        y = quant_grouped_mm(x, qw, s, counts, fmt)
        assert y.dtype == dtype and torch.equal(y, quant_grouped_mm_torch(x, qw, s, counts, fmt))
        x_BTK = x.reshape(1, -1, I)
        y = quant_linear(x_BTK, qw[0], s[0], fmt)
        assert y.shape == (1, 9, O) and torch.equal(y, quant_linear_torch(x_BTK, qw[0], s[0], fmt))
