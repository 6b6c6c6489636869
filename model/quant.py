"""Quantized weights of a K3Model: the release format, the quantized modules, and quantization-aware training as a
property of the model (model/README.md "Quantized release checkpoints").

Module selections (`--modules` of `k3 quantize`) and the kinds of tensors they quantize:

    routed_experts   GroupedExperts.gate_up_proj [E, 2F, L] and down_proj [E, L, F] (~all of a large MoE's bytes)
    experts          + the shared experts (LatentMoE.shared_experts: two nn.Linear)
    all_linear       + every other nn.Linear: attention projections, latent projections, the dense MLP, the MTP
                     module and the LM head, except MLA's kv_b_proj, whose weight the absorbed decode folds into the
                     queries and values as a matrix (architecture.md 6.2); embeddings, norms, the router and the
                     short convolutions stay in the release dtype

On disk a quantized weight keeps its name and gains `<name>.scales` (style.md 5B); config.json carries

    "quantization_config": {"quant_method": "k3", "format": "w4a8" | "w4a16" | "w8a16", "group_size": 32 | null,
                            "modules": ["routed_experts", ("shared_experts", ("linear"))], "mode": "ptq" | "qat",
                            "k3_quant_version": 2}

(version 1, written before modules and mode were chosen, means routed experts and ptq). Stored tensors: int4
formats uint8 [.., N, K/2] (two values per byte, low nibble = even index) + fp32 [.., N, K/group]; w8a16 int8
[.., N, K] + fp32 [.., N, 1].

QAT: `enable_fake_quant` sets the chosen modules' `fake_quant` (GroupedExperts) or makes them FakeQuantLinear, whose
forward is nn.Linear's on fake-quantized weights and activations: the layers' own math. With absmax scales the state
dict is unchanged; with learned scales (LSQ, k3.kernels.quant.fake) each quantized weight `<name>` gains an fp32
parameter `<name>_scales` [.., N, K/g] that the optimizer, checkpoints and resume carry like any other.
`quantize_state_dict` then converts with the scales the fake quantizer used (`pop_learned_scales` takes the learned
ones out of the state dict), so the release computes what was trained. `apply_quantization` swaps in QuantGroupedExperts / QuantLinear before a quantized release is assigned.

Legend: E experts, L latent width, F expert width, N out-features, K in-features, G = K / group_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.kernels.quant import (
    FORMATS,
    INT4_FORMATS,
    FakeQuant,
    dequantize_weight,
    int4_group_scales,
    quant_grouped_mm,
    quant_linear,
)
from k3.kernels.quant import quantize_weight as _kernel_quantize_weight

from .config import CheckpointError, ModelConfig
from .moe import GroupedExperts, LatentMoE

QUANT_METHOD = "k3"
K3_QUANT_VERSION = 2
MODULE_CHOICES = {"routed_experts": ["routed_experts"], "experts": ["routed_experts", "shared_experts"],
                  "all_linear": ["routed_experts", "shared_experts", "linear"]}
MODES = ("ptq", "qat")
# w8a16 exists for the experts' memory (dequantize + a bf16 matmul); the dense linears have fused kernels only for
# int4, so all_linear takes the int4 formats
FORMATS_OF_KIND = {"routed_experts": FORMATS, "shared_experts": FORMATS, "linear": INT4_FORMATS}
# int4 group sizes the fused kernels tile (powers of two dividing their 128-wide K step; 32 = the MXFP4 block of
# K3's QAT recipe)
GROUP_SIZES = (16, 32, 64, 128)
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
UNQUANTIZED_LINEARS = ("kv_b_proj",)  # read as matrices by the absorbed MLA decode (module docstring)
SCALES_SUFFIX = ".scales"  # on-disk name suffix; the module attribute is `<name>_scales` (no dots in attributes)
SCALES_ATTR = "_scales"  # `<name>_scales`: a quantized module's scale buffers, or QAT's learned scale parameters
QAT_SCALES = ("absmax", "learned")  # quantize.scales: how QAT's fake quantizer gets its int4 scales
_KEYS = ("quant_method", "format", "group_size", "modules", "mode", "k3_quant_version")


# --------------------------------------------------------------------------------------------------------------------
# quantization_config


def make_quantization_config(fmt: str = "w4a8", group_size: int | None = 32, modules: str = "routed_experts",
                             mode: str = "ptq") -> dict:
    """The config.json["quantization_config"] for a format, a `--modules` choice and a mode (validated); w8a16 is
    per channel: group_size -> None. Example: make_quantization_config("w4a8", 32, "experts")["modules"]"""
    if modules not in MODULE_CHOICES:
        raise CheckpointError(f"modules {modules!r} is not a module selection; use one of {list(MODULE_CHOICES)}")
    qc = {"quant_method": QUANT_METHOD, "format": fmt, "group_size": group_size if fmt in INT4_FORMATS else None,
          "modules": list(MODULE_CHOICES[modules]), "mode": mode, "k3_quant_version": K3_QUANT_VERSION}
    return validate_quantization_config(qc, where="quantization_config")


def validate_quantization_config(qc: object, where: str = "config.json") -> dict:
    """Check a quantization_config dict; raise CheckpointError naming `where`, the bad value and the fix. Returns
    it in the current version's form (a version-1 config gains mode "ptq").

    Example: validate_quantization_config({"quant_method": "k3", "format": "w8a16", "group_size": None,
                                           "modules": ["routed_experts"], "k3_quant_version": 1})
    """
    pre = f"{where}: quantization_config"
    if not isinstance(qc, dict):
        raise CheckpointError(f"{pre} must be a JSON object, got {type(qc).__name__}; re-export with k3 quantize")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise CheckpointError(f"{pre}.quant_method is {method!r}; k3 loads only quant_method {QUANT_METHOD!r} "
                              "(written by k3 quantize); re-quantize the bf16 release with k3")
    version = qc.get("k3_quant_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"{pre}.k3_quant_version is missing or not a positive integer ({version!r}); "
                              "the file was not written by k3, re-export the checkpoint")
    if version > K3_QUANT_VERSION:
        raise CheckpointError(f"{pre}.k3_quant_version {version} is newer than this k3 supports "
                              f"({K3_QUANT_VERSION}); upgrade k3 to load it")
    keys = _KEYS if version >= 2 else tuple(k for k in _KEYS if k != "mode")
    unknown = sorted(set(qc) - set(keys))
    if unknown:
        raise CheckpointError(f"{pre} has unknown keys {unknown}; expected only {list(keys)} (upgrade k3 if the "
                              "checkpoint is from a newer version)")
    fmt = qc.get("format")
    if fmt not in FORMATS or (version == 1 and fmt == "w4a16"):
        raise CheckpointError(f"{pre}.format {fmt!r} is not a k3 quantization format; use one of {list(FORMATS)}")
    group = qc.get("group_size")
    if fmt in INT4_FORMATS and (isinstance(group, bool) or group not in GROUP_SIZES):
        raise CheckpointError(f"{pre}.group_size {group!r} is not supported for {fmt}; use one of "
                              f"{list(GROUP_SIZES)} (32 is the default)")
    if fmt == "w8a16" and group is not None:
        raise CheckpointError(f"{pre}.group_size {group!r}: w8a16 is per output channel, so group_size must be "
                              "null")
    modules = qc.get("modules")
    choices = [MODULE_CHOICES["routed_experts"]] if version == 1 else list(MODULE_CHOICES.values())
    if modules not in choices:
        raise CheckpointError(f"{pre}.modules is {modules!r}; this k3 quantizes one of {choices}")
    for kind in modules:
        if fmt not in FORMATS_OF_KIND[kind]:
            raise CheckpointError(f"{pre}: format {fmt} does not support the {kind} modules ({fmt} is for the "
                                  f"experts only); use {' or '.join(FORMATS_OF_KIND[kind])}, or modules experts")
    mode = qc.get("mode", "ptq")
    if mode not in MODES:
        raise CheckpointError(f"{pre}.mode {mode!r} is not one of {list(MODES)}")
    return {"quant_method": method, "format": fmt, "group_size": group, "modules": list(modules), "mode": mode,
            "k3_quant_version": K3_QUANT_VERSION}


# --------------------------------------------------------------------------------------------------------------------
# modules


class _QuantBuffers(nn.Module):
    """Stored quantized weights as buffers `<name>` + fp32 `<name>_scales` (state-dict names `<name>.scales`)."""

    WEIGHTS: tuple[str, ...] = ()

    def _register(self, shapes: dict[str, tuple[tuple[int, ...], int]], fmt: str, group_size: int | None) -> None:
        """shapes: name -> (leading dims + (N,), K)."""
        self.fmt, self.group_size = fmt, group_size if fmt in INT4_FORMATS else None
        for name, (lead, k) in shapes.items():
            if fmt in INT4_FORMATS:
                q = torch.zeros(*lead, k // 2, dtype=torch.uint8)
                s = torch.zeros(*lead, k // group_size, dtype=torch.float32)
            else:
                q, s = torch.zeros(*lead, k, dtype=torch.int8), torch.zeros(*lead, 1, dtype=torch.float32)
            self.register_buffer(name, q)
            self.register_buffer(name + "_scales", s)
        self.register_state_dict_post_hook(_scales_to_disk_names)
        self.register_load_state_dict_pre_hook(_scales_from_disk_names)

    def _apply(self, fn, recurse=True):
        # a float cast (`model.to(torch.bfloat16)`) would round the scales; keep them fp32 like the checkpoint does
        old = {n: getattr(self, n + "_scales") for n in self.WEIGHTS}
        super()._apply(fn, recurse)
        for n, s in old.items():
            new = getattr(self, n + "_scales")
            if new.dtype != torch.float32 and not new.is_meta:
                setattr(self, n + "_scales", s.to(device=new.device, dtype=torch.float32))
        return self

    def logical_weights(self) -> list[tuple[str, int]]:
        """(name, element count) of the unquantized weights these buffers stand for
        (model.transformer.weight_numels)."""
        per_byte = 2 if self.fmt in INT4_FORMATS else 1  # int4: two values per byte along the in-features
        return [(n, getattr(self, n).numel() * per_byte) for n in self.WEIGHTS]

    def dequantized(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized weight `name` as [.., N, K] in `dtype` (for references)."""
        return dequantize_weight(getattr(self, name), getattr(self, name + "_scales"), self.fmt, dtype)


def _scales_to_disk_names(module, state_dict, prefix, local_metadata):
    for n in module.WEIGHTS:
        if prefix + n + "_scales" in state_dict:
            state_dict[prefix + n + SCALES_SUFFIX] = state_dict.pop(prefix + n + "_scales")


def _scales_from_disk_names(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                            error_msgs):
    for n in module.WEIGHTS:
        if prefix + n + SCALES_SUFFIX in state_dict:
            state_dict[prefix + n + "_scales"] = state_dict.pop(prefix + n + SCALES_SUFFIX)


class QuantGroupedExperts(_QuantBuffers, GroupedExperts):
    """GroupedExperts on stored quantized weights (same forward: only `expert_mm` differs), x_ML [M, L],
    counts_E [E] -> y_ML [M, L]. Buffers: `gate_up_proj` [E, 2F, L/2 | L] + `gate_up_proj_scales` [E, 2F, L/g | 1],
    `down_proj` [E, L, F/2 | F] + `down_proj_scales` [E, L, F/g | 1]. Scales stay fp32 under `module.to(dtype)`.
    """

    WEIGHTS = EXPERT_WEIGHTS

    def __init__(self, num_experts: int, d_latent: int, d_ff: int, fmt: str = "w4a8", group_size: int | None = 32,
                 act: str = "c2glu", beta1: float = 4.0, beta2: float = 25.0):
        nn.Module.__init__(self)  # not GroupedExperts.__init__: the weights are buffers here, not parameters
        if fmt not in FORMATS:
            raise ValueError(f"unknown quantization format {fmt!r}; use one of {FORMATS}")
        if fmt in INT4_FORMATS and (not group_size or d_latent % group_size or d_ff % group_size or group_size % 2):
            raise ValueError(f"{fmt} group size {group_size} must be even and divide the expert in-features "
                             f"(latent {d_latent}, expert width {d_ff}); pick another group_size")
        self.d_ff, self.act, self.beta1, self.beta2 = d_ff, act, beta1, beta2
        self.fake_quant, self.input_observer = None, None
        E = num_experts
        self._register({"gate_up_proj": ((E, 2 * d_ff), d_latent), "down_proj": ((E, d_latent), d_ff)},
                       fmt, group_size)

    def reset_parameters(self) -> None:  # stored weights come from a checkpoint
        pass

    def expert_mm(self, x_MI: torch.Tensor, name: str, counts_E: torch.Tensor) -> torch.Tensor:
        return quant_grouped_mm(x_MI, getattr(self, name), getattr(self, name + "_scales"), counts_E, self.fmt)

    def extra_repr(self) -> str:
        return f"fmt={self.fmt}, group_size={self.group_size}, experts={self.gate_up_proj.shape[0]}"


class QuantLinear(_QuantBuffers):
    """A bias-free nn.Linear on a stored quantized weight: x [..., K] -> [..., N] (k3.kernels.quant.quant_linear).
    Buffers `weight` [N, K/2 | K] + `weight_scales` [N, K/g | 1] (state-dict name `weight.scales`)."""

    WEIGHTS = ("weight",)

    def __init__(self, in_features: int, out_features: int, fmt: str = "w4a16", group_size: int | None = 32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._register({"weight": ((out_features,), in_features)}, fmt, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.weight, self.weight_scales, self.fmt)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}, group_size={self.group_size}"


class FakeQuantLinear(nn.Linear):
    """nn.Linear whose forward runs on `fake_quant` weights and activations (QAT); same parameters and names."""

    fake_quant: FakeQuant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.fake_quant.weight(self.weight, getattr(self, "weight" + SCALES_ATTR, None))
        return F.linear(self.fake_quant.act(x), w, self.bias)


# --------------------------------------------------------------------------------------------------------------------
# which tensors a selection quantizes


def quant_targets(model: nn.Module, kinds: list[str]) -> list[tuple[str, nn.Module, str]]:
    """(module name, module, kind) of every module the kinds select (module docstring), in model order: each
    GroupedExperts (two weights), or an nn.Linear (its `weight`).

    Example: [n for n, _, _ in quant_targets(model, ["routed_experts"])][0] == "model.layers.1.mlp.experts"
    """
    shared = {id(lin) for m in model.modules() if isinstance(m, LatentMoE) and m.shared_experts is not None
              for lin in m.shared_experts.modules() if isinstance(lin, nn.Linear)}
    out = []
    for name, m in model.named_modules():
        if isinstance(m, GroupedExperts) and not isinstance(m, QuantGroupedExperts):
            kind = "routed_experts"
        elif isinstance(m, nn.Linear):
            if name.rpartition(".")[2] in UNQUANTIZED_LINEARS:
                continue
            kind = "shared_experts" if id(m) in shared else "linear"
        else:
            continue
        if kind in kinds:
            out.append((name, m, kind))
    return out


def module_weights(name: str, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(state-dict name, tensor) of the weights a target module `name` quantizes."""
    if isinstance(module, GroupedExperts):
        return [(f"{name}.{n}", getattr(module, n)) for n in EXPERT_WEIGHTS]
    return [(f"{name}.weight", module.weight)]


def check_targets(model: nn.Module, qc: dict) -> list[tuple[str, nn.Module, str]]:
    """quant_targets of `qc["modules"]`, after the checks a user can act on: something to quantize, no tied head
    under all_linear, and a group size dividing every selected tensor's in-features (CheckpointError naming the
    tensor, its size and the group sizes that work)."""
    targets = quant_targets(model, qc["modules"])
    if not any(kind == "routed_experts" for _, _, kind in targets):
        raise CheckpointError("the model has no routed experts (first_k_dense = n_layers); nothing to quantize")
    if "linear" in qc["modules"] and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        raise CheckpointError("modules all_linear would quantize the LM head, which this model ties to the "
                              "embedding table; use modules experts")
    group = qc["group_size"]
    if group:
        sizes = {n: int(w.shape[-1]) for name, m, _ in targets for n, w in module_weights(name, m)}
        for n, k in sizes.items():
            if k % group:
                works = [g for g in GROUP_SIZES if all(v % g == 0 for v in sizes.values())]
                raise CheckpointError(f"group size {group} does not divide the in-features {k} of {n}; group sizes "
                                      f"that divide every selected tensor: {works or 'none'}"
                                      + ("" if works else "; select fewer modules"))
    return targets


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def enable_fake_quant(model: nn.Module, quantization_config: dict, *, scales: str = "absmax",
                      init_scales: dict[str, torch.Tensor] | None = None, scale_lr: float = 1.0) -> nn.Module:
    """Make `model` quantization-aware for `quantization_config` (its format, group size and modules): routed
    experts get `fake_quant`, selected nn.Linear become FakeQuantLinear holding the same Parameter objects (so an
    optimizer built before or after sees the same tensors, and state-dict names do not change).

    scales: "absmax" (recomputed from the weights on every forward) or "learned" (int4 formats; w8a16 stays per-
    channel absmax): each selected weight `<name>` gets a trainable fp32 parameter `<name>_scales` [.., N, K/g]
    initialised from init_scales[<state-dict name>] where given (calibrated clipping), else absmax / 7; scale_lr: the
    multiplier of the learning rate those parameters train at (k3.train.optim). In place; returns `model`.

    Example: enable_fake_quant(model, make_quantization_config("w4a8", 32, "all_linear", "qat"), scales="learned")
    """
    qc = validate_quantization_config(quantization_config, where="quantization_config")
    if scales not in QAT_SCALES:
        raise CheckpointError(f"scales {scales!r}: use one of {list(QAT_SCALES)}")
    learned = scales == "learned" and qc["format"] in INT4_FORMATS
    spec = FakeQuant(qc["format"], qc["group_size"], learned=learned, scale_lr=scale_lr)
    for name, m, _ in check_targets(model, qc):
        if not isinstance(m, GroupedExperts | FakeQuantLinear):
            with torch.device("meta"):
                fq = FakeQuantLinear(m.in_features, m.out_features, bias=m.bias is not None)
            fq.weight, fq.bias = m.weight, m.bias
            _replace(model, name, fq)
            m = fq
        m.fake_quant = spec
        if learned:
            for key, w in module_weights(name, m):
                given = (init_scales or {}).get(key)
                s = int4_group_scales(w, qc["group_size"]) if given is None else given.detach().float().clone()
                if s.shape != (*w.shape[:-1], w.shape[-1] // qc["group_size"]):
                    raise CheckpointError(f"init scales of {key} are {tuple(s.shape)}, expected "
                                          f"{(*w.shape[:-1], w.shape[-1] // qc['group_size'])}")
                m.register_parameter(key.rpartition(".")[2] + SCALES_ATTR, nn.Parameter(s.to(w.device)))
    return model


def pop_learned_scales(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split a QAT model's state dict: (the weights without the learned `<name>_scales`, {<name>: scales}) for
    `quantize_state_dict(..., scales=...)`. A state dict without learned scales comes back unchanged with {}."""
    rest, scales = {}, {}
    for k, t in sd.items():
        if k.endswith(SCALES_ATTR) and k[:-len(SCALES_ATTR)] in sd:
            scales[k[:-len(SCALES_ATTR)]] = t
        else:
            rest[k] = t
    return rest, scales


def quantize_module(module: nn.Module, fmt: str, group_size: int | None,
                    scales: dict[str, torch.Tensor] | None = None) -> _QuantBuffers:
    """A quantized copy (QuantGroupedExperts / QuantLinear, same device) of one GroupedExperts or nn.Linear;
    scales: optional int4 scales per weight name ("gate_up_proj", "weight", ...), default RTN."""
    if isinstance(module, GroupedExperts):
        E, two_f, L = module.gate_up_proj.shape
        q = QuantGroupedExperts(E, L, two_f // 2, fmt, group_size, module.act, module.beta1, module.beta2)
    else:
        q = QuantLinear(module.in_features, module.out_features, fmt, group_size)
    q = q.to(module_weights("", module)[0][1].device)
    with torch.no_grad():
        for n in q.WEIGHTS:
            qw, s = _kernel_quantize_weight(getattr(module, n).detach(), fmt, q.group_size, (scales or {}).get(n))
            getattr(q, n).copy_(qw)
            getattr(q, n + "_scales").copy_(s)
    return q


def quantize_experts(module: GroupedExperts, fmt: str = "w4a8", group_size: int | None = 32) -> QuantGroupedExperts:
    """Round-to-nearest quantization of one GroupedExperts: a new QuantGroupedExperts on the same device.

    Example: model.model.layers[1].mlp.experts = quantize_experts(model.model.layers[1].mlp.experts, "w8a16")
    """
    return quantize_module(module, fmt, group_size)


# --------------------------------------------------------------------------------------------------------------------
# state dicts and loading


def _meta_model(cfg: ModelConfig) -> nn.Module:
    from .transformer import K3Model  # the selection is defined on the model's modules; built without memory

    with torch.device("meta"):
        return K3Model(cfg)


def expert_weight_names(cfg: ModelConfig) -> list[str]:
    """State-dict names of the routed expert weights of a K3Model with `cfg`."""
    return [f"model.layers.{i}.mlp.experts.{n}" for i, t in enumerate(cfg.mlp_types) if t == "moe"
            for n in EXPERT_WEIGHTS]


def quantized_weight_names(cfg: ModelConfig, quantization_config: dict) -> list[str]:
    """State-dict names of every weight `quantization_config` quantizes in a K3Model with `cfg` (checked)."""
    model = _meta_model(cfg)
    return [n for name, m, _ in check_targets(model, quantization_config) for n, _ in module_weights(name, m)]


def quantize_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, fmt: str = "w4a8",
                        group_size: int | None = 32, modules: str = "routed_experts", mode: str = "ptq", *,
                        scales: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantize the selected weights of a K3Model state dict: (new state dict, quantization_config).

    Each selected weight [.., N, K] becomes the quantized `<name>` plus `<name>.scales`, by round-to-nearest on
    `scales[<name>]` where given (calibrated clipping, or the scales a fake quantizer used) and on absmax scales
    otherwise (which is what FakeQuant computes from the same weights); other tensors pass through unchanged (same
    objects). Raises CheckpointError for an invalid format / selection / group size, an already-quantized state
    dict, or selected tensors missing or mis-shaped for `cfg`.

    Example: qsd, qc = quantize_state_dict(model.state_dict(), cfg, "w4a8", 32, "all_linear", "qat")
    """
    qc = make_quantization_config(fmt, group_size, modules, mode)
    if any(k.endswith(SCALES_SUFFIX) for k in sd):
        raise CheckpointError("the state dict is already quantized (it holds '.scales' tensors); quantize the "
                              "bf16 / fp32 release instead")
    model = _meta_model(cfg)
    want = {n: tuple(w.shape) for name, m, _ in check_targets(model, qc) for n, w in module_weights(name, m)}
    for name, shape in want.items():
        t = sd.get(name)
        if t is None or tuple(t.shape) != shape or not t.is_floating_point():
            got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise CheckpointError(f"weight {name} is {got}, expected floating {shape}; the state dict does not "
                                  "belong to this config")
    out: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        if k in want:
            given = None if scales is None else scales.get(k)
            out[k], out[k + SCALES_SUFFIX] = _kernel_quantize_weight(t.detach(), fmt, qc["group_size"], given)
        else:
            out[k] = t
    return out, qc


def apply_quantization(model: nn.Module, quantization_config: dict) -> nn.Module:
    """Swap every selected module of `model` for an (empty) QuantGroupedExperts / QuantLinear of the config's
    format, on the same device (meta included), so that a quantized state dict loads into it. Returns `model`
    (changed in place).

    Example: model = apply_quantization(K3Model(cfg), read_quantization_config(ckpt)); load_state_into(model, sd)
    """
    qc = validate_quantization_config(quantization_config, where="quantization_config")
    try:
        targets = check_targets(model, qc)
    except CheckpointError as e:
        raise CheckpointError(f"quantization_config: {e}; the config and the weights disagree, re-export the "
                              "checkpoint") from None
    for name, m, _ in targets:
        w = module_weights(name, m)[0][1]
        with torch.device(w.device):
            if isinstance(m, GroupedExperts):
                E, two_f, L = m.gate_up_proj.shape
                q = QuantGroupedExperts(E, L, two_f // 2, qc["format"], qc["group_size"], m.act, m.beta1, m.beta2)
            else:
                q = QuantLinear(m.in_features, m.out_features, qc["format"], qc["group_size"])
        _replace(model, name, q)
    return model
