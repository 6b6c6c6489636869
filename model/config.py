"""ModelConfig: every architectural knob of a K3 model, and strict dict -> dataclass coercion.

Standard library only (style.md section 4). `ModelConfig` is what travels with released weights as config.json;
training knobs never enter it. Field comments name the K3 / Kimi-Linear config key where one exists.

`config_from_dict(cls, data)` is the one strict loader used by every config section in k3: unknown keys are errors
listing close matches, values are coerced to the field's annotated type (YAML parses `1e-4` as a string, so scalar
types from YAML are never trusted), and wrong types are errors naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any

K3_FORMAT_VERSION = 1  # bump when a change to ModelConfig or tensor names breaks old checkpoints


class ConfigError(ValueError):
    """A config value or key is invalid; the message names the key and the fix."""


class CheckpointError(ValueError):
    """A checkpoint is missing, foreign, too new, corrupt or inconsistent; the message names the file and the fix."""


# --------------------------------------------------------------------------------------------------------------------
# strict coercion


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Coerce `value` to annotation `tp`, raising ConfigError naming `key` on mismatch."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own error is the useful one
            return _coerce(value, options[0], key)
        for a in options:
            try:
                return _coerce(value, a, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} does not match any of {[_type_name(a) for a in args]}")
    if origin is typing.Literal:
        if value in args:
            return value
        raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
    if origin in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        inner = args[0] if args else Any
        out = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return out if origin is list else tuple(out)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        kt, vt = args if args else (Any, Any)
        return {_coerce(k, kt, key): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for section {tp.__name__}, got {value!r}")
        return config_from_dict(tp, value, prefix=f"{key}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got a boolean {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
            if f.is_integer():
                return int(f)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got a boolean {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def config_from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from `data` strictly (unknown keys and wrong types raise ConfigError).

    Example: config_from_dict(ModelConfig, {"d_model": "256"}).d_model == 256
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for k, v in data.items():
        if k not in fields:
            close = difflib.get_close_matches(str(k), list(fields), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"unknown config key '{prefix}{k}'{hint}")
        kwargs[k] = _coerce(v, hints[k], f"{prefix}{k}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None
    except ValueError as e:  # the section's own checks (__post_init__)
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from None


def config_to_dict(obj: Any) -> dict:
    """Plain-Python dict of a (nested) config dataclass, lists instead of tuples, for YAML/JSON."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            v = config_to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


# --------------------------------------------------------------------------------------------------------------------
# ModelConfig


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Architecture of a K3 model (architecture.md). Defaults are the `k3-debug` preset."""

    name: str = "k3-debug"  # preset name, informational
    vocab_size: int = 512  # vocab; untied embedding and head (K3: 163840)
    d_model: int = 64  # hidden size d (K3: 7168)
    n_layers: int = 4  # number of layers L
    full_attn_layers: list[int] = field(default_factory=lambda: [4])  # 1-based MLA layer indices; others are KDA
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon everywhere
    initializer_range: float = 0.02  # std of normal init for linear and embedding weights
    tie_word_embeddings: bool = False  # K3 unties embedding and LM head

    # KDA (kda.md section 4)
    kda_num_heads: int = 2  # H
    kda_head_dim: int = 32  # d_k = d_v
    kda_conv_kernel: int = 4  # causal short convolution width
    kda_gate_lower_bound: float | None = -5.0  # lower-bound gate lb in [-5, 0); None = Kimi-Linear softplus gate
    kda_chunk_size: int = 64  # chunk length of the chunkwise form (32 or 64)

    # gated MLA (architecture.md section 6); HF/DeepSeek names in comments
    mla_num_heads: int = 2  # H
    q_lora_rank: int = 32  # q_a_proj output
    kv_lora_rank: int = 32  # latent c_kv width
    qk_nope_head_dim: int = 16  # per-head content dim
    qk_rope_head_dim: int = 8  # per-head rope slot (unrotated under nope); 0 = pure NoPE
    v_head_dim: int = 16  # per-head value dim
    mla_use_output_gate: bool = True  # sigmoid output gate per head-channel
    mla_position: str = "rope"  # "rope" (pretraining) | "nope" (after extend-context; K3)
    rope_theta: float = 10000.0  # RoPE base, used only in rope mode

    # MLP / MoE (architecture.md sections 7-9)
    hidden_act: str = "c2glu"  # "c2glu" (K3 SiTU, tanh-bounded) | "swiglu"
    c2glu_beta1: float = 4.0  # gate bound (activation_situ_beta)
    c2glu_beta2: float = 25.0  # up bound (activation_situ_linear_beta)
    dense_intermediate_size: int = 128  # layer-0 dense MLP width
    first_k_dense: int = 1  # number of leading layers with a dense MLP (K3: 1)
    num_experts: int = 8  # routed experts E
    num_experts_per_tok: int = 2  # top-K
    moe_latent_size: int = 32  # latent width l (routed_expert_hidden_size), K3: d/2
    moe_intermediate_size: int = 32  # expert width m
    num_shared_experts: int = 2  # full-width shared experts, m each
    latent_norm_pos: str = "pre_up"  # "pre_up" (K3) | "post_down" (ablation) | "none" (Nemotron LatentMoE)
    routed_scaling_factor: float = 1.0  # multiplies routed output (K3: 1.0)

    # residual stream (architecture.md section 4)
    residual: str = "attnres"  # "attnres" (Block Attention Residuals) | "preln" (plain Pre-LN, ablation)
    attn_res_block_size: int = 2  # AttnRes block size in layers

    # multi-token prediction (architecture.md section 10)
    mtp_depth: int = 1  # number of MTP modules (0 or 1)

    k3_format_version: int = K3_FORMAT_VERSION  # checkpoint format version

    # ---------------------------------------------------------------- derived
    @property
    def mla_layers(self) -> list[int]:
        """0-based indices of MLA layers (from the 1-based `full_attn_layers`)."""
        return [i - 1 for i in self.full_attn_layers]

    @property
    def layer_types(self) -> list[str]:
        """'kda' or 'mla' per 0-based layer."""
        mla = set(self.mla_layers)
        return ["mla" if i in mla else "kda" for i in range(self.n_layers)]

    @property
    def mlp_types(self) -> list[str]:
        """'dense' or 'moe' per 0-based layer."""
        return ["dense" if i < self.first_k_dense else "moe" for i in range(self.n_layers)]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Values cached per token per MLA layer: c_kv + shared k_rope."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_attnres_sources(self) -> int:
        """Sources seen by the output AttnRes: completed blocks (incl. embedding) + the running partial."""
        return len(range(0, self.n_layers, self.attn_res_block_size)) + 1

    def validate(self) -> ModelConfig:
        """Check cross-field constraints; raise ConfigError naming the field and the fix."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        for f in ("vocab_size", "d_model", "n_layers", "kda_num_heads", "kda_head_dim", "mla_num_heads",
                  "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "dense_intermediate_size",
                  "num_experts", "num_experts_per_tok", "moe_latent_size", "moe_intermediate_size",
                  "attn_res_block_size", "kda_conv_kernel"):
            need(getattr(self, f) > 0, f"model.{f} must be positive, got {getattr(self, f)}")
        need(self.qk_rope_head_dim >= 0, "model.qk_rope_head_dim must be >= 0")
        need(self.num_shared_experts >= 0, "model.num_shared_experts must be >= 0")
        bad = [i for i in self.full_attn_layers if not 1 <= i <= self.n_layers]
        need(not bad, f"model.full_attn_layers are 1-based in [1, {self.n_layers}]; out of range: {bad}")
        need(len(set(self.full_attn_layers)) == len(self.full_attn_layers), "model.full_attn_layers has duplicates")
        need(self.num_experts_per_tok <= self.num_experts,
             f"model.num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts ({self.num_experts})")
        need(0 <= self.first_k_dense <= self.n_layers, "model.first_k_dense must lie in [0, n_layers]")
        lb = self.kda_gate_lower_bound
        need(lb is None or -5.0 <= lb < 0.0, f"model.kda_gate_lower_bound must lie in [-5, 0) or be null, got {lb}")
        need(self.kda_chunk_size in (16, 32, 64), "model.kda_chunk_size must be 16, 32 or 64")
        need(self.mla_position in ("rope", "nope"), f"model.mla_position must be 'rope' or 'nope', got {self.mla_position!r}")
        need(self.mla_position == "nope" or self.qk_rope_head_dim % 2 == 0,
             "model.qk_rope_head_dim must be even for rope mode")
        need(self.hidden_act in ("c2glu", "swiglu"), f"model.hidden_act must be 'c2glu' or 'swiglu', got {self.hidden_act!r}")
        need(self.latent_norm_pos in ("pre_up", "post_down", "none"),
             f"model.latent_norm_pos must be pre_up, post_down or none, got {self.latent_norm_pos!r}")
        need(self.residual in ("attnres", "preln"), f"model.residual must be 'attnres' or 'preln', got {self.residual!r}")
        need(self.mtp_depth in (0, 1), "model.mtp_depth must be 0 or 1")
        need(self.k3_format_version <= K3_FORMAT_VERSION,
             f"model.k3_format_version {self.k3_format_version} is newer than this k3 supports ({K3_FORMAT_VERSION});"
             " upgrade k3")
        return self

    def to_dict(self) -> dict:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        return config_from_dict(cls, data, prefix="model.").validate()
