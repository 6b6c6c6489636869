"""The fake quantizer of QAT (k3kernels/quant/fake.py) against a reference written here with Python's own rounding:
ties at .5 (half to even, as torch.round), the clamp edges of int4 [-8, 7] and int8 [-127, 127], all-zero groups,
bit equality with quantize-then-dequantize, and the straight-through gradient inside and outside the range; the
learned-scale (LSQ) quantizer's forward and both its gradients against the same reference, a hand-written rule and
finite differences."""

import pytest
import torch

from k3.kernels.quant import (
    FakeQuant,
    dequantize_weight,
    fake_quant_act,
    fake_quant_fp8_per_token,
    fake_quant_weight,
    fake_quant_weight_lsq,
    int4_group_scales,
    lsq_grad_scale,
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


# --------------------------------------------------------------------------------------------------------------------
# learned scales (LSQ)


def ref_lsq_grads(w: torch.Tensor, s: torch.Tensor, up: torch.Tensor, gs: float) -> tuple[list, list]:
    """(dL/dw, dL/ds) of L = sum(up * Q(w; s)) by LSQ's rule, element by element in Python floats: r = w / s,
    q = clamp(round(r), -8, 7); inside [-8, 7]: dw = up, ds += up * (q - r); outside: dw = 0, ds += up * q;
    a scale <= 0: no gradient."""
    K = w.shape[-1]
    W, U, S = w.reshape(-1, K).tolist(), up.reshape(-1, K).tolist(), s.reshape(-1, s.shape[-1]).tolist()
    group = w.shape[-1] // s.shape[-1]
    dw, ds = [], []
    for wr, ur, sr in zip(W, U, S, strict=True):
        dwr, dsr = [], []
        for j, sj in enumerate(sr):
            acc = 0.0
            for v, u in zip(wr[j * group:(j + 1) * group], ur[j * group:(j + 1) * group], strict=True):
                if sj <= 0:
                    dwr.append(0.0)
                    continue
                r = v / sj
                q = max(-8, min(7, round(r)))
                if -8 <= r <= 7:
                    dwr.append(u)
                    acc += u * (q - r)
                else:
                    dwr.append(0.0)
                    acc += u * q
            dsr.append(acc * gs)
        dw.append(dwr)
        ds.append(dsr)
    return dw, ds


def test_lsq_forward_equals_the_reference_and_the_release():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 6, 64, generator=g) * torch.logspace(-3, 1, 6)[None, :, None]
    w[1, 2, :16] = 0.0  # an all-zero group keeps scale 0
    s = int4_group_scales(w, 16) * (0.5 + 0.6 * torch.rand(2, 6, 4, generator=g))  # clipped and widened groups
    out = fake_quant_weight_lsq(w, s.requires_grad_())
    codes, vals = ref_int4(w, 16, s.detach())
    assert torch.equal(out, vals) and codes.min() == -8 and codes.max() == 7
    qw, s_stored = quantize_weight(w, "w4a8", 16, s.detach())
    assert torch.equal(out, dequantize_weight(qw, s_stored, "w4a8"))  # what a release on these scales computes
    assert torch.equal(out.detach(), fake_quant_weight(w, "w4a8", 16, s.detach()))  # the fixed-scale path's bits
    assert torch.equal(out[1, 2, :16], torch.zeros(16))


def test_lsq_gradients_against_the_hand_written_rule():
    # s = 1 and 0.5 (exact quotients): ties at .5 (half to even), the edges -8 and 7 (inside), just beyond them
    # (clamped), far beyond; a third group with scale 0 gets nothing
    w = torch.tensor([[0.25, 2.5, 3.5, -0.5, 7.0, 7.25, -8.0, -8.25,
                       1.25, 1.75, -3.75, 3.5, 50.0, -50.0, 0.0, -2.25,
                       0.3, -0.4, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    s = torch.tensor([[1.0, 0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    up = torch.arange(1.0, 25.0, dtype=torch.float64).reshape(1, 24) * torch.tensor([1.0, -1.0]).repeat(12)
    out = fake_quant_weight_lsq(w, s)
    out.backward(up)
    gs = lsq_grad_scale(8)
    assert gs == pytest.approx(1 / 56 ** 0.5)
    dw, ds = ref_lsq_grads(w.detach(), s.detach(), up, gs)
    assert w.grad.tolist() == dw and s.grad[0].tolist() == pytest.approx(ds[0], rel=1e-12, abs=1e-15)
    # spelled out for the first group: q - r = -0.25, -0.5 (2.5 -> 2), 0.5 (3.5 -> 4), 0.5 (-0.5 -> -0), 0 at the
    # edges 7 and -8, the bounds 7 and -8 beyond them
    first = [-0.25, -0.5, 0.5, 0.5, 0.0, 7.0, 0.0, -8.0]
    assert s.grad[0, 0].item() == pytest.approx(gs * sum(u * d for u, d in zip(up[0, :8].tolist(), first,
                                                                               strict=True)), rel=1e-12)
    assert w.grad[0, :8].tolist() == [1.0, -2.0, 3.0, -4.0, 5.0, 0.0, 7.0, 0.0]
    assert s.grad[0, 2].item() == 0.0 and w.grad[0, 16:].abs().sum() == 0
    # random fp32 tensors: the same rule (the fp32 sum against the float64 one), and grad_scale overrides gs
    g = torch.Generator().manual_seed(0)
    w2 = (torch.randn(3, 5, 32, generator=g) * 0.1).requires_grad_()
    s2 = (int4_group_scales(w2, 8) * (0.4 + 0.8 * torch.rand(3, 5, 4, generator=g))).requires_grad_()
    up2 = torch.randn(3, 5, 32, generator=g)
    fake_quant_weight_lsq(w2, s2, grad_scale=1.0).backward(up2)
    dw2, ds2 = ref_lsq_grads(w2.detach().double(), s2.detach().float().double(), up2.double(), 1.0)
    assert w2.grad.reshape(15, 32).tolist() == dw2
    assert torch.allclose(s2.grad.reshape(15, 4).double(), torch.tensor(ds2, dtype=torch.float64), rtol=1e-5,
                          atol=1e-6)


def test_lsq_scale_gradient_against_finite_differences():
    """Where every element is clamped the fake-quant weight is s * bound, linear in s: its finite difference is the
    gradient. Elsewhere rounding makes it a staircase, and LSQ's gradient is the rounding residual over s plus the
    derivative of the unrounded quantizer clamp(w, -8 s, 7 s), which is smooth between the kinks at r = -8, 7."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 32, generator=g, dtype=torch.float64)
    up = torch.randn(4, 32, generator=g, dtype=torch.float64)
    h = 1e-7

    def loss(fn, s):
        return (up * fn(s)).sum().item()

    def fd(fn, s, i):
        e = torch.zeros_like(s)
        e.view(-1)[i] = h
        return (loss(fn, s + e) - loss(fn, s - e)) / (2 * h)

    # saturated: |w| / s > 8 for every element
    sat = torch.full((4, 2), 1e-3, dtype=torch.float64).requires_grad_()
    wbig = w.sign() * (w.abs() + 0.1)
    fake_quant_weight_lsq(wbig, sat, grad_scale=1.0).backward(up)
    for i in range(8):
        assert sat.grad.view(-1)[i].item() == pytest.approx(fd(lambda s: fake_quant_weight_lsq(wbig, s), sat.detach(),
                                                               i), rel=1e-6)
    # unsaturated: scales chosen so no r lies within 0.05 of a clamp kink
    s = (int4_group_scales(w, 16).double() * torch.tensor([0.55, 0.9])).requires_grad_()
    r = w.reshape(4, 2, 16) / s.detach()[..., None]
    assert ((r - 7).abs().min() > 0.05) and ((r + 8).abs().min() > 0.05) and (r.abs() > 7).any()
    fake_quant_weight_lsq(w, s, grad_scale=1.0).backward(up)

    def unrounded(s):
        s_e = s.repeat_interleave(16, -1)
        return torch.minimum(torch.maximum(w, -8 * s_e), 7 * s_e)

    residual = ((up * (fake_quant_weight_lsq(w, s.detach()) - unrounded(s.detach()))).reshape(4, 2, 16).sum(-1)
                / s.detach())
    for i in range(8):
        want = residual.view(-1)[i].item() + fd(unrounded, s.detach(), i)
        assert s.grad.view(-1)[i].item() == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_learned_spec_needs_the_module_scales():
    w = torch.randn(4, 32)
    spec = FakeQuant("w4a8", 16, learned=True)
    with pytest.raises(ValueError, match="needs the module's scales"):
        spec.weight(w)
    s = int4_group_scales(w, 16)
    assert torch.equal(spec.weight(w, s), fake_quant_weight(w, "w4a8", 16))  # absmax scales: the RTN bits
    with pytest.raises(ValueError, match="do not fit weights"):
        fake_quant_weight_lsq(w, s[:, :1].expand(4, 3).contiguous())
