"""Quantized routed experts for release checkpoints (model/README.md "Quantized release checkpoints").

Only the routed experts (`GroupedExperts.gate_up_proj` [E, 2F, L] and `down_proj` [E, L, F], ~all of a large MoE's
weights) are quantized; every other tensor keeps the release dtype. On disk a quantized weight keeps its name and
gains `<name>.scales` (style.md 5B); method, format and group size live in `config.json["quantization_config"]`:

    {"quant_method": "k3", "format": "w4a8" | "w8a16", "group_size": 32 | null, "modules": ["routed_experts"],
     "k3_quant_version": 1}

- w4a8: `<name>` uint8 [E, N, K/2] (int4 pairs, low nibble = even index), `<name>.scales` fp32 [E, N, K/group];
  activations fake-quantized per token to FP8 e4m3fn at run time.
- w8a16: `<name>` int8 [E, N, K], `<name>.scales` fp32 [E, N, 1] (per output channel; group_size null).

This module: the format's config validation, `QuantGroupedExperts` (GroupedExperts' forward contract on quantized
buffers), round-to-nearest (RTN) post-training quantization of a module / state dict / release directory, and the
load-side `apply_quantization` that swaps GroupedExperts for QuantGroupedExperts before the weights are loaded.
The kernels are k3.kernels.quant (plain PyTorch: dequantize, then the grouped matmul).

Legend: E experts, L latent width, F expert width, N out-features, K in-features, G = K / group_size.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.kernels.quant import (
    FORMATS,
    dequantize_weight,
    quant_grouped_mm,
    quantize_int4_grouped,
    quantize_int8_channel,
)

from .config import CheckpointError, ModelConfig
from .layers import glu_activation
from .moe import GroupedExperts

QUANT_METHOD = "k3"
K3_QUANT_VERSION = 1
QUANT_MODULES = ["routed_experts"]
# int4 group sizes a future fused kernel can tile (powers of two; 32 = the MXFP4 block of K3's QAT recipe)
GROUP_SIZES = (16, 32, 64, 128)
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
SCALES_SUFFIX = ".scales"  # on-disk name suffix; the module attribute is `<name>_scales` (no dots in attributes)
_KEYS = ("quant_method", "format", "group_size", "modules", "k3_quant_version")


# --------------------------------------------------------------------------------------------------------------------
# quantization_config


def make_quantization_config(fmt: str = "w4a8", group_size: int | None = 32) -> dict:
    """The config.json["quantization_config"] for a format (validated). w8a16 is per channel: group_size -> None.

    Example: make_quantization_config("w4a8", 32)["group_size"] == 32
    """
    qc = {"quant_method": QUANT_METHOD, "format": fmt, "group_size": group_size if fmt == "w4a8" else None,
          "modules": list(QUANT_MODULES), "k3_quant_version": K3_QUANT_VERSION}
    return validate_quantization_config(qc, where="quantization_config")


def validate_quantization_config(qc: object, where: str = "config.json") -> dict:
    """Check a quantization_config dict; raise CheckpointError naming `where`, the bad value and the fix.

    Example: validate_quantization_config({"quant_method": "k3", "format": "w8a16", "group_size": None,
                                           "modules": ["routed_experts"], "k3_quant_version": 1})
    """
    pre = f"{where}: quantization_config"
    if not isinstance(qc, dict):
        raise CheckpointError(f"{pre} must be a JSON object, got {type(qc).__name__}; re-export with k3 quantize")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise CheckpointError(f"{pre}.quant_method is {method!r}; k3 loads only quant_method {QUANT_METHOD!r} "
                              "(written by k3.train.quantize.quantize_release); re-quantize the bf16 "
                              "release with k3")
    version = qc.get("k3_quant_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"{pre}.k3_quant_version is missing or not a positive integer ({version!r}); "
                              "the file was not written by k3, re-export the checkpoint")
    if version > K3_QUANT_VERSION:
        raise CheckpointError(f"{pre}.k3_quant_version {version} is newer than this k3 supports "
                              f"({K3_QUANT_VERSION}); upgrade k3 to load it")
    unknown = sorted(set(qc) - set(_KEYS))
    if unknown:
        raise CheckpointError(f"{pre} has unknown keys {unknown}; expected only {list(_KEYS)} (upgrade k3 if the "
                              "checkpoint is from a newer version)")
    fmt = qc.get("format")
    if fmt not in FORMATS:
        raise CheckpointError(f"{pre}.format {fmt!r} is not a k3 quantization format; use one of {list(FORMATS)}")
    group = qc.get("group_size")
    if fmt == "w4a8" and (isinstance(group, bool) or group not in GROUP_SIZES):
        raise CheckpointError(f"{pre}.group_size {group!r} is not supported for w4a8; use one of "
                              f"{list(GROUP_SIZES)} (32 is the default)")
    if fmt == "w8a16" and group is not None:
        raise CheckpointError(f"{pre}.group_size {group!r}: w8a16 is per output channel, so group_size must be "
                              "null")
    if qc.get("modules") != QUANT_MODULES:
        raise CheckpointError(f"{pre}.modules is {qc.get('modules')!r}; this k3 quantizes only "
                              f"{QUANT_MODULES}")
    return {k: qc[k] for k in _KEYS}


# --------------------------------------------------------------------------------------------------------------------
# the module


class QuantGroupedExperts(nn.Module):
    """GroupedExperts on quantized weights: x_ML [M, L], counts_E [E] -> y_ML [M, L] (same contract and glu).

    Buffers (`fmt` "w4a8": uint8 packed int4 + fp32 group scales; "w8a16": int8 + fp32 channel scales):
    `gate_up_proj` [E, 2F, L/2 | L] with `gate_up_proj_scales` [E, 2F, L/g | 1], `down_proj` [E, L, F/2 | F] with
    `down_proj_scales` [E, L, F/g | 1]. state_dict() names the scales `gate_up_proj.scales` / `down_proj.scales`
    (the on-disk names; load_state_dict accepts them). Scales stay fp32 under `module.to(dtype)`.
    """

    def __init__(self, num_experts: int, d_latent: int, d_ff: int, fmt: str = "w4a8", group_size: int | None = 32,
                 act: str = "c2glu", beta1: float = 4.0, beta2: float = 25.0):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown quantization format {fmt!r}; use one of {FORMATS}")
        if fmt == "w4a8" and (not group_size or d_latent % group_size or d_ff % group_size or group_size % 2):
            raise ValueError(f"w4a8 group size {group_size} must be even and divide the expert in-features "
                             f"(latent {d_latent}, expert width {d_ff}); pick another group_size")
        self.d_ff, self.act, self.beta1, self.beta2 = d_ff, act, beta1, beta2
        self.fmt, self.group_size = fmt, group_size if fmt == "w4a8" else None
        E = num_experts
        for name, (n, k) in zip(EXPERT_WEIGHTS, ((2 * d_ff, d_latent), (d_latent, d_ff))):
            if fmt == "w4a8":
                q = torch.zeros(E, n, k // 2, dtype=torch.uint8)
                s = torch.zeros(E, n, k // group_size, dtype=torch.float32)
            else:
                q, s = torch.zeros(E, n, k, dtype=torch.int8), torch.zeros(E, n, 1, dtype=torch.float32)
            self.register_buffer(name, q)
            self.register_buffer(name + "_scales", s)
        self.register_state_dict_post_hook(_scales_to_disk_names)
        self.register_load_state_dict_pre_hook(_scales_from_disk_names)

    def _apply(self, fn, recurse=True):
        # a float cast (`model.to(torch.bfloat16)`) would round the scales; keep them fp32 like the checkpoint does
        old = {n: getattr(self, n + "_scales") for n in EXPERT_WEIGHTS}
        super()._apply(fn, recurse)
        for n, s in old.items():
            new = getattr(self, n + "_scales")
            if new.dtype != torch.float32 and not new.is_meta:
                setattr(self, n + "_scales", s.to(device=new.device, dtype=torch.float32))
        return self

    def logical_weights(self) -> list[tuple[str, int]]:
        """(name, element count) of the unquantized weights these buffers stand for (model.transformer.weight_numels):
        gate_up_proj [E, 2F, L] and down_proj [E, L, F]."""
        per_byte = 2 if self.fmt == "w4a8" else 1  # w4a8: two int4 values per byte along the in-features
        return [(n, getattr(self, n).numel() * per_byte) for n in EXPERT_WEIGHTS]

    def dequantized(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized weight `name` ("gate_up_proj" | "down_proj") as [E, N, K] in `dtype` (for references)."""
        return dequantize_weight(getattr(self, name), getattr(self, name + "_scales"), self.fmt, dtype)

    def forward(self, x_ML: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """x_ML [M, L] rows grouped by expert (counts_E [E] rows each) -> y_ML [M, L], each row through its expert."""
        gu_M2F = quant_grouped_mm(x_ML, self.gate_up_proj, self.gate_up_proj_scales, counts_E, self.fmt)
        gate_MF, up_MF = gu_M2F.split(self.d_ff, dim=-1)
        h_MF = glu_activation(gate_MF, up_MF, self.act, self.beta1, self.beta2)
        return quant_grouped_mm(h_MF, self.down_proj, self.down_proj_scales, counts_E, self.fmt)

    def extra_repr(self) -> str:
        return f"fmt={self.fmt}, group_size={self.group_size}, experts={self.gate_up_proj.shape[0]}"


def _scales_to_disk_names(module, state_dict, prefix, local_metadata):
    for n in EXPERT_WEIGHTS:
        if prefix + n + "_scales" in state_dict:
            state_dict[prefix + n + SCALES_SUFFIX] = state_dict.pop(prefix + n + "_scales")


def _scales_from_disk_names(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                            error_msgs):
    for n in EXPERT_WEIGHTS:
        if prefix + n + SCALES_SUFFIX in state_dict:
            state_dict[prefix + n + "_scales"] = state_dict.pop(prefix + n + SCALES_SUFFIX)


def _quantize_weight(w: torch.Tensor, fmt: str, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "w4a8":
        return quantize_int4_grouped(w, group_size)
    if fmt == "w8a16":
        return quantize_int8_channel(w)
    raise CheckpointError(f"unknown quantization format {fmt!r}; use one of {list(FORMATS)}")


def quantize_experts(module: GroupedExperts, fmt: str = "w4a8", group_size: int | None = 32) -> QuantGroupedExperts:
    """Round-to-nearest quantization of one GroupedExperts: a new QuantGroupedExperts on the same device.

    Example: model.model.layers[1].mlp.experts = quantize_experts(model.model.layers[1].mlp.experts, "w8a16")
    """
    E, two_f, L = module.gate_up_proj.shape
    q = QuantGroupedExperts(E, L, two_f // 2, fmt, group_size, module.act, module.beta1, module.beta2)
    q = q.to(module.gate_up_proj.device)
    with torch.no_grad():
        for n in EXPERT_WEIGHTS:
            qw, s = _quantize_weight(getattr(module, n).detach(), fmt, q.group_size)
            getattr(q, n).copy_(qw)
            getattr(q, n + "_scales").copy_(s)
    return q


# --------------------------------------------------------------------------------------------------------------------
# state dicts, models, release directories


def expert_weight_names(cfg: ModelConfig) -> list[str]:
    """State-dict names of the routed expert weights of a K3Model with `cfg` (the tensors this format quantizes)."""
    return [f"model.layers.{i}.mlp.experts.{n}" for i, t in enumerate(cfg.mlp_types) if t == "moe"
            for n in EXPERT_WEIGHTS]


def quantize_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, fmt: str = "w4a8",
                        group_size: int | None = 32) -> tuple[dict[str, torch.Tensor], dict]:
    """RTN-quantize the routed experts of a K3Model state dict: (new state dict, quantization_config).

    Each `...mlp.experts.{gate_up_proj,down_proj}` [E, N, K] becomes the quantized `<name>` plus `<name>.scales`;
    other tensors are passed through unchanged (same objects). Raises CheckpointError for an invalid format or group
    size, an already-quantized state dict, or expert tensors missing / mis-shaped for `cfg`.

    Example: qsd, qc = quantize_state_dict(model.state_dict(), cfg, "w4a8", 32)
    """
    qc = make_quantization_config(fmt, group_size)
    if any(k.endswith(SCALES_SUFFIX) for k in sd):
        raise CheckpointError("the state dict is already quantized (it holds '.scales' tensors); quantize the "
                              "bf16 / fp32 release instead")
    names = expert_weight_names(cfg)
    if not names:
        raise CheckpointError("the model has no routed experts (first_k_dense = n_layers); nothing to quantize")
    want = {"gate_up_proj": (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.moe_latent_size),
            "down_proj": (cfg.num_experts, cfg.moe_latent_size, cfg.moe_intermediate_size)}
    for name in names:
        t = sd.get(name)
        shape = want[name.rpartition(".")[2]]
        if t is None or tuple(t.shape) != shape or not t.is_floating_point():
            got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise CheckpointError(f"routed expert weight {name} is {got}, expected floating {shape}; the state dict "
                                  "does not belong to this config")
        if qc["group_size"] and shape[2] % qc["group_size"]:
            raise CheckpointError(f"group_size {qc['group_size']} does not divide the in-features {shape[2]} of "
                                  f"{name}; pick a group_size from {list(GROUP_SIZES)} that divides it")
    out: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        if k in names:
            out[k], out[k + SCALES_SUFFIX] = _quantize_weight(t.detach(), fmt, qc["group_size"])
        else:
            out[k] = t
    return out, qc


def apply_quantization(model: nn.Module, quantization_config: dict) -> nn.Module:
    """Swap every GroupedExperts in `model` for an (empty) QuantGroupedExperts of the config's format, on the same
    device (meta included), so that a quantized state dict loads into it. Returns `model` (changed in place).

    Example: model = apply_quantization(K3Model(cfg), read_quantization_config(ckpt)); load_state_into(model, sd)
    """
    qc = validate_quantization_config(quantization_config, where="quantization_config")
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    for name, m in targets:
        E, two_f, L = m.gate_up_proj.shape
        group = qc["group_size"]
        if group and (L % group or (two_f // 2) % group):
            raise CheckpointError(f"quantization_config.group_size {group} does not divide the expert in-features "
                                  f"(latent {L}, expert width {two_f // 2}) of {name}; the config and the weights "
                                  "disagree, re-export the checkpoint")
        with torch.device(m.gate_up_proj.device):
            q = QuantGroupedExperts(E, L, two_f // 2, qc["format"], group, m.act, m.beta1, m.beta2)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, q)
    return model
