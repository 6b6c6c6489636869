"""The fake quantizer of QAT (k3kernels/quant/fake.py) against a reference written here with Python's own rounding:
ties at .5 (half to even, as torch.round), the clamp edges of int4 [-8, 7] and int8 [-127, 127], all-zero groups,
bit equality with quantize-then-dequantize, and the straight-through gradient inside and outside the range."""

import pytest
import torch

from k3.kernels.quant import (
    FakeQuant,
    dequantize_weight,
    fake_quant_act,
    fake_quant_fp8_per_token,
    fake_quant_weight,
    int4_group_scales,
    quantize_weight,
)


def ref_int4(w: torch.Tensor, group: int, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, values) per element by a Python loop: s = max|w| / 7 in fp32 (or given), q = round(w / s) with
    Python's round (half to even) on the float64 quotient, clamped to [-8, 7]; value = fp32(q * s)."""
    flat = w.reshape(-1, w.shape[-1]).tolist()
    codes, vals = [], []
    for r, row in enumerate(flat):
        crow, vrow = [], []
        for j in range(0, len(row), group):
            g = row[j:j + group]
            if scales is None:
                s = float(torch.tensor(max(abs(v) for v in g), dtype=torch.float32) / 7)
            else:
                s = float(scales.reshape(len(flat), -1)[r, j // group])
            for v in g:
                q = 0 if s == 0 else max(-8, min(7, round(v / s)))
                crow.append(q)
                vrow.append(float(torch.tensor(q * s, dtype=torch.float32)))
        codes.append(crow)
        vals.append(vrow)
    return torch.tensor(codes).reshape(w.shape), torch.tensor(vals, dtype=torch.float32).reshape(w.shape)


def test_ties_round_half_to_even_and_clamp_edges():
    # group of 8 with max |w| = 7: s = 1 exactly, so w / s is exact and ties are exact ties
    w = torch.tensor([[0.5, 1.5, 2.5, -3.5, 6.5, -6.5, 7.0, -0.5]])
    out = fake_quant_weight(w, "w4a16", 8)
    assert out.tolist() == [[0.0, 2.0, 2.0, -4.0, 6.0, -6.0, 7.0, -0.0]]
    assert torch.equal(out, ref_int4(w, 8)[1])
    # given (clipped) scales: 7.5 rounds to 8 and clamps to 7; -8.5 rounds to -8 (even); beyond saturates
    s = torch.tensor([[1.0]])
    w = torch.tensor([[7.49, 7.5, 8.0, 100.0, -8.0, -8.5, -8.51, -1e4]])
    assert fake_quant_weight(w, "w4a8", 8, s).tolist() == [[7.0, 7.0, 7.0, 7.0, -8.0, -8.0, -8.0, -8.0]]
    # int8 per channel: max |w| = 127 gives s = 1; 126.5 -> 126, -0.5 -> 0, the max maps to 127 exactly
    w8 = torch.tensor([[126.5, -0.5, 1.5, -127.0, 127.0, 2.5]])
    assert fake_quant_weight(w8, "w8a16", None).tolist() == [[126.0, -0.0, 2.0, -127.0, 127.0, 2.0]]


@pytest.mark.parametrize("group", [16, 32])
def test_random_groups_and_zero_groups_match_reference(group):
    w = torch.randn(3, 5, 64) * torch.logspace(-3, 2, 5)[None, :, None]
    w[0, 0, :group] = 0.0  # an all-zero group: scale 0, values 0
    w[2, 4, -group:] = 0.0
    out = fake_quant_weight(w, "w4a8", group)
    codes, vals = ref_int4(w, group)
    assert torch.equal(out, vals)
    assert torch.equal(out[0, 0, :group], torch.zeros(group)) and torch.equal(out[2, 4, -group:], torch.zeros(group))
    assert codes.abs().max() <= 7  # absmax scales never need -8
    # the release of the same weight dequantizes to the same bits (what QAT converts to)
    for fmt in ("w4a8", "w4a16", "w8a16"):
        qw, s = quantize_weight(w, fmt, group)
        assert torch.equal(fake_quant_weight(w, fmt, group), dequantize_weight(qw, s, fmt)), fmt
        # bf16 autocast casts QAT's fp32 fake-quant weight once, as a bf16 release dequantizes: the same bits
        assert torch.equal(fake_quant_weight(w, fmt, group).bfloat16(), dequantize_weight(qw, s, fmt, torch.bfloat16))
    # calibrated (given) scales: same reference, codes may reach -8
    clipped = int4_group_scales(w, group) * 0.6
    codes_c, vals_c = ref_int4(w, group, clipped)
    assert torch.equal(fake_quant_weight(w, "w4a16", group, clipped), vals_c) and codes_c.min() == -8


def test_ste_gradient_inside_and_outside_the_range():
    s = torch.tensor([[0.5, 2.0]])  # two groups of 4
    w = torch.tensor([[0.1, 3.5, 3.6, -4.0, 1.0, 14.0, -16.0, -16.5]], requires_grad=True)
    up = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]])
    fake_quant_weight(w, "w4a8", 4, s).backward(up)
    # w / s: 0.2, 7, 7.2, -8 | 0.5, 7, -8, -8.25: the gradient passes on [-8, 7] (edges included), else 0
    assert w.grad.tolist() == [[1.0, 2.0, 0.0, 4.0, 5.0, 6.0, 7.0, 0.0]]
    # absmax scales keep every element inside: the gradient is the upstream gradient
    w2 = torch.randn(4, 64, requires_grad=True)
    g = torch.randn(4, 64)
    fake_quant_weight(w2, "w4a16", 32).backward(g)
    assert torch.equal(w2.grad, g)
    w3 = torch.randn(4, 64, requires_grad=True)
    fake_quant_weight(w3, "w8a16", None).backward(g)
    assert torch.equal(w3.grad, g)


def test_activation_fake_quant_and_spec():
    x = torch.randn(6, 40, requires_grad=True)
    y = fake_quant_act(x, "w4a8")
    assert torch.equal(y, fake_quant_fp8_per_token(x.detach()))
    g = torch.randn(6, 40)
    y.backward(g)
    assert torch.equal(x.grad, g)  # identity gradient
    assert fake_quant_act(x, "w4a16") is x and fake_quant_act(x, "w8a16") is x
    spec = FakeQuant("w4a8", 32)
    w = torch.randn(8, 64)
    assert torch.equal(spec.weight(w), fake_quant_weight(w, "w4a8", 32))
    assert torch.equal(spec.act(x.detach()), fake_quant_fp8_per_token(x.detach()))
    with pytest.raises(ValueError, match="unknown quantization format"):
        fake_quant_weight(w, "nf4", 32)
    with pytest.raises(ValueError, match="floating"):
        fake_quant_weight(w.to(torch.int8), "w4a8", 32)
