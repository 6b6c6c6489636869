"""Quantized weights: int4 packing, symmetric group / channel quantization, per-token FP8 activation fake-quant,
the fake quantizer with its straight-through estimator (fake.py), and the quantized matmuls: `quant_grouped_mm`
(routed experts) and `quant_linear` (dense). On the triton backend the int4 formats run the fused dequant GEMMs of
triton.py; the PyTorch twins (naive.py: dequantize, then the matmul) run on the CPU and for float64 references."""

import torch

from k3.kernels.dispatch import resolve

from .fake import FakeQuant, fake_quant_act, fake_quant_weight, fake_quant_weight_lsq, lsq_grad_scale
from .naive import (
    FORMATS,
    INT4_FORMATS,
    dequantize_int4_grouped,
    dequantize_int8_channel,
    dequantize_weight,
    fake_quant_fp8_per_token,
    int4_group_codes,
    int4_group_dequant,
    int4_group_scales,
    pack_int4,
    quant_grouped_mm_torch,
    quant_linear_torch,
    quantize_activations,
    quantize_int4_grouped,
    quantize_int8_channel,
    quantize_weight,
    unpack_int4,
)


def quant_grouped_mm(x_MI: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, counts_E: torch.Tensor,
                     fmt: str, impl: str = "auto") -> torch.Tensor:
    """y[rows of e] = A(x[rows of e]) @ deq(w[e]).T for x_MI [M, I] grouped by expert (counts_E [E]) on stored
    expert weights of format `fmt` (naive.quant_grouped_mm_torch has the shapes). Returns [M, O] in x's dtype.

    Example: y_MO = quant_grouped_mm(x_MI, qw_EOI2, s_EOG, counts_E, "w4a8")
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; use one of {FORMATS}")
    return resolve("quant_grouped_mm", quant_grouped_mm_torch, like=x_MI)(x_MI, qweight, scales, counts_E, fmt, impl)


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """y = A(x) @ deq(w).T for x [..., K] and one stored weight [N, K/2 | K] of format `fmt` -> [..., N].

    Example: y = quant_linear(x_BTD, qw_ND2, s_NG, "w4a16")
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; use one of {FORMATS}")
    return resolve("quant_linear", quant_linear_torch, like=x)(x, qweight, scales, fmt)


__all__ = ["FORMATS", "INT4_FORMATS", "FakeQuant", "dequantize_int4_grouped", "dequantize_int8_channel",
           "dequantize_weight", "fake_quant_act", "fake_quant_fp8_per_token", "fake_quant_weight",
           "fake_quant_weight_lsq", "int4_group_codes", "int4_group_dequant", "int4_group_scales", "lsq_grad_scale",
           "pack_int4", "quant_grouped_mm", "quant_grouped_mm_torch",
           "quant_linear", "quant_linear_torch", "quantize_activations", "quantize_int4_grouped",
           "quantize_int8_channel", "quantize_weight", "unpack_int4"]
