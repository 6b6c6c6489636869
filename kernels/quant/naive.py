"""Weight quantization of routed experts in plain PyTorch: int4 packing, symmetric group / channel quantization,
per-token FP8 activation fake-quant, and the dequantize-then-grouped-matmul that serves quantized experts.

Legend: E experts, N out-features (rows of an nn.Linear weight), K in-features (the last, reduced dim),
G = K / group_size groups per row, M routed rows, I in-features of x (= K).

Formats (k3.model.quant writes them into release checkpoints; model/README.md "Quantized release checkpoints"):
- "w4a8": int4 weights, symmetric, one fp32 scale per group of `group_size` consecutive in-features,
  w ~= q * s with q in [-8, 7], s = absmax(group) / 7 (round-to-nearest; -8 only from QAT). Two values per byte,
  the even index in the low nibble. Activations are quantized per token (row) to float8_e4m3fn with the scale
  absmax(row) / 448 (448 = the largest finite e4m3fn value; OCP FP8 spec, "OFP8 Formats for Deep Learning",
  Micikevicius et al. 2022, arXiv 2209.05433). Emulated here: quantize, dequantize, matmul in the compute dtype.
- "w8a16": int8 weights, symmetric, one fp32 scale per output channel, s = absmax(row) / 127, q in [-127, 127];
  activations stay in the compute dtype.
Symmetric formats need no zero points (the `.zeros` of style.md are absent).

No fused kernel yet: `quant_grouped_mm` materializes the dequantized weights in x's dtype on every call
(kernels/README.md lists a fused dequant grouped GEMM as remaining work).
"""

from __future__ import annotations

import torch

from k3.kernels.moe import moe_grouped_mm

FORMATS = ("w4a8", "w8a16")
INT4_MIN, INT4_MAX = -8, 7
INT8_MAX = 127
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def _check_int_range(q: torch.Tensor, lo: int, hi: int, what: str) -> None:
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{what}: values must lie in [{lo}, {hi}], got [{int(q.min())}, {int(q.max())}]; "
                         "clamp them (or quantize with quantize_int4_grouped)")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int4 values two per byte along the last dim: out[..., j] = (q[..., 2j] & 15) | (q[..., 2j+1] & 15) << 4.

    Args: q [..., K] integer tensor with values in [-8, 7]; K must be even.
    Returns: uint8 [..., K/2] (low nibble = even index, two's complement nibbles).

    Example: pack_int4(torch.tensor([1, -1])) == tensor([0xF1], dtype=torch.uint8)
    """
    if q.is_floating_point() or q.dtype == torch.bool:
        raise ValueError(f"pack_int4 expects an integer tensor, got {q.dtype}; round and cast to torch.int8 first")
    if q.dim() == 0 or q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even last dimension (two values per byte), got shape {tuple(q.shape)};"
                         " pad the in-features to an even size")
    _check_int_range(q, INT4_MIN, INT4_MAX, "pack_int4")
    u = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [..., K/2] -> int8 [..., K] with values in [-8, 7].

    Example: unpack_int4(torch.tensor([0xF1], dtype=torch.uint8)) == tensor([1, -1], dtype=torch.int8)
    """
    if p.dtype != torch.uint8:
        raise ValueError(f"unpack_int4 expects packed uint8 bytes, got {p.dtype}")
    if p.dim() == 0:
        raise ValueError("unpack_int4 expects a tensor with at least one dimension, got a scalar")
    lo = (p & 0xF).to(torch.int8)
    hi = (p >> 4).to(torch.int8)
    q = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., K/2, 2] -> [..., K], even index first
    return (q ^ 8) - 8  # sign-extend a 4-bit two's complement nibble: 0..7 stay, 8..15 -> -8..-1


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    if w.dim() < 1 or group_size <= 0 or w.shape[-1] % group_size:
        raise ValueError(f"group size {group_size} must be positive and divide the last dim of shape "
                         f"{tuple(w.shape)}; pick a group size that divides the in-features")
    return w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)


def quantize_int4_grouped(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int4 per group of `group_size` along the last dim.

    Args: w [..., K] floating (K divisible by group_size and even).
    Returns: (packed uint8 [..., K/2], scales fp32 [..., K/group_size]); s = absmax / 7 (0 for an all-zero group),
    q = round(w / s) in [-7, 7], so |w - q s| <= s / 2 per element.

    Example: qw, s = quantize_int4_grouped(experts.gate_up_proj.detach(), 32)   # [E, 2F, L/2], [E, 2F, L/32]
    """
    if not w.is_floating_point():
        raise ValueError(f"quantize_int4_grouped expects floating weights, got {w.dtype}")
    w_G = _groups(w.float(), group_size)  # [..., G, group]
    s_G = w_G.abs().amax(-1) / INT4_MAX
    safe = torch.where(s_G > 0, s_G, torch.ones_like(s_G))  # an all-zero group quantizes to 0 with scale 0
    q = torch.round(w_G / safe.unsqueeze(-1)).clamp_(INT4_MIN, INT4_MAX).to(torch.int8)
    return pack_int4(q.flatten(-2)), s_G


def dequantize_int4_grouped(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
                            ) -> torch.Tensor:
    """packed uint8 [..., K/2], scales [..., G] -> w [..., K] in `dtype` (q * s computed in fp32, float64 for a
    float64 `dtype`, then cast once). The group size is K / G.

    Example: w = dequantize_int4_grouped(qw, s, torch.bfloat16)
    """
    q = unpack_int4(packed)
    K, G = q.shape[-1], scales.shape[-1]
    if scales.shape[:-1] != q.shape[:-1] or G == 0 or K % G:
        raise ValueError(f"int4 weights {tuple(q.shape)} (unpacked) and scales {tuple(scales.shape)} disagree: "
                         "scales must be [..., K / group_size] with the same leading dims")
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    w_G = q.to(ct).reshape(*q.shape[:-1], G, K // G) * scales.to(ct).unsqueeze(-1)
    return w_G.flatten(-2).to(dtype)


def quantize_int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int8 per output channel (one scale per row of the last dim).

    Args: w [..., N, K] floating. Returns: (q int8 [..., N, K] in [-127, 127], scales fp32 [..., N, 1]),
    s = absmax(row) / 127 (0 for an all-zero row), |w - q s| <= s / 2.

    Example: q, s = quantize_int8_channel(experts.down_proj.detach())   # [E, L, F], [E, L, 1]
    """
    if not w.is_floating_point():
        raise ValueError(f"quantize_int8_channel expects floating weights, got {w.dtype}")
    w = w.float()
    s = w.abs().amax(-1, keepdim=True) / INT8_MAX
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / safe).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, s


def dequantize_int8_channel(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
                            ) -> torch.Tensor:
    """q int8 [..., N, K], scales [..., N, 1] -> w [..., N, K] in `dtype` (q * s in fp32, float64 for float64)."""
    if q.dtype != torch.int8:
        raise ValueError(f"dequantize_int8_channel expects int8 weights, got {q.dtype}")
    if scales.shape != (*q.shape[:-1], 1):
        raise ValueError(f"int8 weights {tuple(q.shape)} need scales {(*q.shape[:-1], 1)}, got {tuple(scales.shape)}")
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(ct) * scales.to(ct)).to(dtype)


def fake_quant_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Per-token (per-row) FP8 e4m3fn quantize + dequantize: s = absmax(row) / 448, out = e4m3(x / s) * s.

    Args: x [..., I] floating. Returns: [..., I] in x's dtype (math in fp32; float64 stays float64). An all-zero row
    stays zero. Emulates "A8" activations: the rounding of a real FP8 GEMM input, not its speed.

    Example: xq_MI = fake_quant_fp8_per_token(x_MI)
    """
    if not x.is_floating_point():
        raise ValueError(f"fake_quant_fp8_per_token expects a floating tensor, got {x.dtype}")
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(ct)
    s = xf.abs().amax(-1, keepdim=True) / FP8_MAX
    safe = torch.where(s > 0, s, torch.ones_like(s))
    # the clamp makes saturation explicit (x / s can exceed 448 by an ulp); torch's cast also saturates
    q = (xf / safe).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.to(ct) * safe).to(x.dtype)


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, fmt: str,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize one stored expert weight of format `fmt` ("w4a8" | "w8a16") to [E, N, K] in `dtype`."""
    if fmt == "w4a8":
        return dequantize_int4_grouped(qweight, scales, dtype)
    if fmt == "w8a16":
        return dequantize_int8_channel(qweight, scales, dtype)
    raise ValueError(f"unknown quantization format {fmt!r}; use one of {FORMATS}")


def quant_grouped_mm(x_MI: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, counts_E: torch.Tensor,
                     fmt: str, impl: str = "auto") -> torch.Tensor:
    """`moe_grouped_mm` on quantized expert weights: y[rows of e] = A(x[rows of e]) @ deq(w[e]).T.

    Args: x_MI [M, I] rows grouped by expert; qweight uint8 [E, O, I/2] (w4a8) or int8 [E, O, I] (w8a16);
    scales fp32 [E, O, I/group] (w4a8) or [E, O, 1] (w8a16); counts_E [E] rows per expert; fmt "w4a8" | "w8a16";
    impl as `moe_grouped_mm`. A = per-token FP8 fake-quant for w4a8, identity for w8a16.
    Returns: y_MO [M, O] in x's dtype; the weights are dequantized (fp32 math) and cast to x's dtype.

    Example: y_MO = quant_grouped_mm(x_MI, qw, s, counts_E, "w4a8")
    """
    w_EOI = dequantize_weight(qweight, scales, fmt, x_MI.dtype)
    if fmt == "w4a8":
        x_MI = fake_quant_fp8_per_token(x_MI)
    return moe_grouped_mm(x_MI, w_EOI, counts_E, impl=impl)
