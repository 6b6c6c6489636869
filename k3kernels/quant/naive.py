"""Weight quantization in plain PyTorch: int4 packing, symmetric group / channel quantization, per-token FP8
activation fake-quant, and the dequantize-then-matmul twins (grouped for experts, dense for linears) of the fused
Triton kernels in triton.py.

Legend: E experts, N out-features (rows of an nn.Linear weight), K in-features (the last, reduced dim),
G = K / group_size groups per row, M routed rows, I in-features of x (= K).

Formats (k3.model.quant writes them into release checkpoints; model/README.md "Quantized release checkpoints"):
- "w4a8": int4 weights, symmetric, one fp32 scale per group of `group_size` consecutive in-features,
  w ~= q * s with q in [-8, 7], s = absmax(group) / 7 (round-to-nearest; -8 only from QAT). Two values per byte,
  the even index in the low nibble. Activations are quantized per token (row) to float8_e4m3fn with the scale
  absmax(row) / 448 (448 = the largest finite e4m3fn value; OCP FP8 spec, "OFP8 Formats for Deep Learning",
  Micikevicius et al. 2022, arXiv 2209.05433). Emulated here: quantize, dequantize, matmul in the compute dtype.
- "w4a16": the int4 weights of "w4a8", activations in the compute dtype.
- "w8a16": int8 weights, symmetric, one fp32 scale per output channel, s = absmax(row) / 127, q in [-127, 127];
  activations stay in the compute dtype.
Symmetric formats need no zero points (the `.zeros` of style.md are absent).

`quant_grouped_mm_torch` / `quant_linear_torch` materialize the dequantized weights in x's dtype on every call (the
CPU path and the reference); the public `quant_grouped_mm` / `quant_linear` in __init__.py dispatch the int4 formats
to the fused Triton GEMMs on the triton backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.kernels.moe import moe_grouped_mm

FORMATS = ("w4a8", "w4a16", "w8a16")
INT4_FORMATS = ("w4a8", "w4a16")  # int4 group-quantized weights (the fused Triton kernels take these)
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


def int4_group_scales(w: torch.Tensor, group_size: int = 32, clip: torch.Tensor | None = None) -> torch.Tensor:
    """RTN scales of symmetric int4 groups: s = clip * absmax(group) / 7, fp32 [..., K/group_size].

    clip: optional ratios in (0, 1] broadcastable to the scales (a calibrated clipping range, k3.train.calibrate);
    None is plain round-to-nearest (clip 1). An all-zero group has scale 0.

    Example: s = int4_group_scales(w_NK, 32)   # [N, K/32]
    """
    if not w.is_floating_point():
        raise ValueError(f"int4_group_scales expects floating weights, got {w.dtype}")
    s_G = _groups(w.detach().float(), group_size).abs().amax(-1) / INT4_MAX
    return s_G if clip is None else s_G * clip.to(s_G)


def int4_group_codes(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 codes q = clamp(round(w / s), -8, 7) [..., K] of w [..., K] on the scales [..., G] (groups of K / G);
    an all-zero scale gives 0. torch.round rounds half to even, so a value at exactly (k + 1/2) s goes to the even
    neighbour. The one rounding rule of every int4 path: RTN export, fake quantization and calibration."""
    G = scales.shape[-1]
    if scales.shape[:-1] != w.shape[:-1] or G == 0 or w.shape[-1] % G:
        raise ValueError(f"int4 scales {tuple(scales.shape)} do not fit weights {tuple(w.shape)}: scales must be "
                         "[..., K / group_size] with the same leading dims")
    s = scales.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group quantizes to 0 with scale 0
    w_G = w.float().reshape(*w.shape[:-1], G, w.shape[-1] // G)
    return torch.round(w_G / safe.unsqueeze(-1)).clamp_(INT4_MIN, INT4_MAX).to(torch.int8).flatten(-2)


def quantize_int4_grouped(w: torch.Tensor, group_size: int = 32, scales: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int4 per group of `group_size` along the last dim.

    Args: w [..., K] floating (K divisible by group_size and even); scales: optional fp32 [..., K/group_size] to
    round on (calibrated clipping: values beyond 7 s clamp to 7, below -8 s to -8), default int4_group_scales(w).
    Returns: (packed uint8 [..., K/2], scales fp32 [..., K/group_size]); RTN: s = absmax / 7 (0 for an all-zero
    group), q = round(w / s) in [-7, 7], so |w - q s| <= s / 2 per element.

    Example: qw, s = quantize_int4_grouped(experts.gate_up_proj.detach(), 32)   # [E, 2F, L/2], [E, 2F, L/32]
    """
    if not w.is_floating_point():
        raise ValueError(f"quantize_int4_grouped expects floating weights, got {w.dtype}")
    s_G = int4_group_scales(w, group_size) if scales is None else scales.float()
    return pack_int4(int4_group_codes(w.detach(), s_G)), s_G


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
    return int4_group_dequant(q, scales, dtype)


def int4_group_dequant(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes q [..., K] (int8 in [-8, 7]) times their group scales [..., G] -> [..., K] in `dtype`: q * s in fp32
    (float64 for float64), cast once. Shared by dequantization and the fake quantizer, so both give the same bits."""
    K, G = q.shape[-1], scales.shape[-1]
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


def quantize_weight(w: torch.Tensor, fmt: str, group_size: int | None,
                    scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One weight [..., N, K] in format `fmt`: (stored tensor, fp32 scales) as `dequantize_weight` reads them.
    int4 formats take optional `scales` (calibrated clipping); w8a16 is per channel and takes none."""
    if fmt in INT4_FORMATS:
        return quantize_int4_grouped(w, group_size, scales)
    if fmt == "w8a16":
        if scales is not None:
            raise ValueError("w8a16 is round-to-nearest per output channel; it takes no calibrated scales")
        return quantize_int8_channel(w)
    raise ValueError(f"unknown quantization format {fmt!r}; use one of {FORMATS}")


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, fmt: str,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize one stored weight of format `fmt` to [..., N, K] in `dtype`."""
    if fmt in INT4_FORMATS:
        return dequantize_int4_grouped(qweight, scales, dtype)
    if fmt == "w8a16":
        return dequantize_int8_channel(qweight, scales, dtype)
    raise ValueError(f"unknown quantization format {fmt!r}; use one of {FORMATS}")


def quantize_activations(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The activation side of format `fmt` on x [..., I]: per-token FP8 fake-quant for w4a8, x itself otherwise."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; use one of {FORMATS}")
    return fake_quant_fp8_per_token(x) if fmt == "w4a8" else x


def quant_grouped_mm_torch(x_MI: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, counts_E: torch.Tensor,
                           fmt: str, impl: str = "auto") -> torch.Tensor:
    """`moe_grouped_mm` on quantized expert weights: y[rows of e] = A(x[rows of e]) @ deq(w[e]).T.

    Args: x_MI [M, I] rows grouped by expert; qweight uint8 [E, O, I/2] (int4 formats) or int8 [E, O, I] (w8a16);
    scales fp32 [E, O, I/group] (int4) or [E, O, 1] (w8a16); counts_E [E] rows per expert; fmt one of FORMATS;
    impl as `moe_grouped_mm`. A = per-token FP8 fake-quant for w4a8, identity otherwise.
    Returns: y_MO [M, O] in x's dtype; the weights are dequantized (fp32 math) and cast to x's dtype.

    Example: y_MO = quant_grouped_mm_torch(x_MI, qw, s, counts_E, "w4a8")
    """
    w_EOI = dequantize_weight(qweight, scales, fmt, x_MI.dtype)
    return moe_grouped_mm(quantize_activations(x_MI, fmt), w_EOI, counts_E, impl=impl)


def quant_linear_torch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """`F.linear` on a quantized weight: x [..., K], qweight [N, K/2] (int4) or [N, K] (w8a16), scales [N, G]
    -> y [..., N] = A(x) @ deq(w).T in x's dtype (A as in quant_grouped_mm_torch).

    Example: y = quant_linear_torch(x_BTD, qw_VD2, s_VG, "w4a16")   # the quantized head
    """
    return F.linear(quantize_activations(x, fmt), dequantize_weight(qweight, scales, fmt, x.dtype))
