"""Quantized routed experts: int4 packing, symmetric group / channel weight quantization, per-token FP8 activation
fake-quant, dequantize + grouped matmul. PyTorch twin only so far (no fused Triton kernel yet)."""

from .naive import (
    FORMATS,
    dequantize_int4_grouped,
    dequantize_int8_channel,
    dequantize_weight,
    fake_quant_fp8_per_token,
    pack_int4,
    quant_grouped_mm,
    quantize_int4_grouped,
    quantize_int8_channel,
    unpack_int4,
)

__all__ = ["FORMATS", "dequantize_int4_grouped", "dequantize_int8_channel", "dequantize_weight",
           "fake_quant_fp8_per_token", "pack_int4", "quant_grouped_mm", "quantize_int4_grouped",
           "quantize_int8_channel", "unpack_int4"]
