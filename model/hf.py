"""Hugging Face transformers classes for k3 release checkpoints: `K3Config` and `K3ForCausalLM`.

Importing this module as `k3.model.hf` registers both with transformers' Auto classes (model_type "k3"), and does
nothing else; then a release directory loads as written by k3 (docs/hf.md):

    import k3.model.hf  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained("runs/tiny/final")
    tok = AutoTokenizer.from_pretrained("runs/tiny/final")

- `K3Config` is a PretrainedConfig holding every ModelConfig field as an attribute; it is parsed and validated by
  k3's own ModelConfig.from_dict (`to_model_config()`), so a field added to ModelConfig needs no change here.
- `K3ForCausalLM` wraps a `K3Model`: K3Model's children are registered under their own names (`model`, `lm_head`,
  `mtp`), so the parameter names are k3's and the math is K3Model.forward itself. `from_pretrained` and
  `save_pretrained` are k3's loader and writer (k3.model.checkpoint), which keep the fp32 tensors fp32 and know
  quantized releases.
- `generate()` carries k3's InferenceState (KDA recurrent states and conv tails, MLA latents) in a `K3Cache`, under
  the cache keyword of the installed transformers (`cache` in 5.x, `past_key_values` in 4.x), and feeds only the
  tokens after the state's seq_len. The state has no padding mask and is not reordered: left-padded batches and
  beam search raise NotImplementedError.

`k3 export-hf` (hf_export.py) embeds this module, with the k3 model code it imports, in an exported directory, where
it is imported under another package name and leaves the Auto registry to transformers' `auto_map`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache import InferenceState
from .checkpoint import HF_CONFIG_KEYS, load_model, read_quantization_config, save_release, trained_seq_len
from .config import ModelConfig, config_to_dict
from .transformer import K3Model, build_model

# the keyword generate() passes the cache under: `cache` from transformers 5.x, `past_key_values` before
CACHE_KWARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
# from_pretrained keywords that only concern where transformers finds the files or its own bookkeeping
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "token", "resume_download")
_IGNORED_KWARGS = ("_from_auto", "_from_pipeline", "adapter_kwargs", "code_revision", "_commit_hash",
                   "trust_remote_code", "use_safetensors", "low_cpu_mem_usage", "attn_implementation")
_PADDING_FIX = ("k3's inference state (KDA recurrent states, MLA latent cache) has no padding mask, so padded "
                "positions would enter the recurrence; generate one prompt at a time (batch size 1, or prompts of "
                "equal length without padding), or serve batches of different lengths with `k3 serve`")


class K3Config(PretrainedConfig):
    """transformers' view of a k3 ModelConfig: every field an attribute, parsed by k3 (ModelConfig.from_dict).

    Example: K3Config.from_model_config(load_model_config("k3-debug")).to_model_config().d_model  # 64
    """

    model_type = "k3"
    # the generic names transformers' utilities read
    attribute_map: ClassVar[dict[str, str]] = {"hidden_size": "d_model", "num_hidden_layers": "n_layers",
                                               "num_attention_heads": "mla_num_heads"}

    def __init__(self, **kwargs):
        fields = {k: kwargs.pop(k) for k in MODEL_FIELDS if k in kwargs}
        cfg = ModelConfig.from_dict(fields)  # strict: wrong types and invalid combinations raise ConfigError
        kwargs["tie_word_embeddings"] = cfg.tie_word_embeddings
        super().__init__(**kwargs)
        for name, value in config_to_dict(cfg).items():
            setattr(self, name, value)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs) -> K3Config:
        """A K3Config of `cfg`'s fields; kwargs are transformers' own keys (e.g. architectures)."""
        return cls(**config_to_dict(cfg), **kwargs)

    def to_model_config(self) -> ModelConfig:
        """The k3 ModelConfig these attributes describe (validated)."""
        return ModelConfig.from_dict({k: getattr(self, k) for k in MODEL_FIELDS})


class K3Cache:
    """k3's InferenceState carried through `generate()` as its cache (transformers' Cache classes hold per-layer
    key/value tensors; k3's state is per-layer KDA recurrences and MLA latents, advanced by K3Model.forward)."""

    is_compileable = False

    def __init__(self, state: InferenceState):
        self.state = state

    @property
    def seq_len(self) -> int:
        return self.state.seq_len

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.state.seq_len

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        raise NotImplementedError("beam search is not supported with k3's inference state; use num_beams=1 "
                                  "(greedy or sampling)")


def _as_k3_cache(cache) -> K3Cache | None:
    """A K3Cache, or None for no cache / an empty transformers cache that generate() made before the first step."""
    if cache is None or isinstance(cache, K3Cache):
        return cache
    if hasattr(cache, "get_seq_length") and cache.get_seq_length() == 0:
        return None
    raise TypeError(f"K3ForCausalLM keeps its state in a K3Cache, got a {type(cache).__name__} that already holds "
                    "tokens; pass no cache (generate() makes one) or the K3Cache a previous call returned")


def _device_of(device_map) -> torch.device:
    if device_map is None:
        return torch.device("cpu")
    if isinstance(device_map, torch.device | int) or isinstance(device_map, str) and device_map not in (
            "auto", "balanced", "balanced_low_0", "sequential"):
        return torch.device(device_map)
    raise NotImplementedError(f"device_map={device_map!r}: a k3 model loads onto one device; pass device_map='cpu' "
                              "or 'cuda' (or a torch.device), or move it afterwards with .to(device)")


class K3ForCausalLM(PreTrainedModel, GenerationMixin):
    """A K3Model as a transformers causal LM (module docstring). `K3ForCausalLM(config)` builds and initialises a
    new K3Model (k3's init, seed 0); `K3ForCausalLM(config, k3_model=m)` wraps an existing one (shared modules)."""

    config_class = K3Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules: ClassVar[list[str]] = ["K3DecoderLayer"]
    _is_stateful = True  # the state cannot be cropped or rewound: no assisted decoding or contrastive search

    def __init__(self, config: K3Config, k3_model: K3Model | None = None):
        super().__init__(config)
        k3 = k3_model if k3_model is not None else build_model(config.to_model_config())
        if k3._parameters or k3._buffers:  # a direct tensor of K3Model would have no name here
            raise TypeError("K3Model holds tensors outside its submodules; K3ForCausalLM registers only its children")
        # not a submodule: its children are registered here under their own names, so state-dict names are k3's
        object.__setattr__(self, "k3_model", k3)
        for name, child in k3.named_children():
            self.add_module(name, child)
        self.post_init()

    def _init_weights(self, module) -> None:
        """Nothing: the weights come from k3's init_weights (build_model) or from the checkpoint."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() must not make a DynamicCache: the first forward makes a K3Cache

    def train(self, mode: bool = True):
        super().train(mode)
        self.k3_model.train(mode)
        return self

    def get_input_embeddings(self):
        return self.k3_model.model.embed_tokens

    def get_output_embeddings(self):
        return self.k3_model.lm_head

    def new_cache(self, batch_size: int = 1) -> K3Cache:
        """An empty K3Cache for `batch_size` sequences."""
        return K3Cache(self.k3_model.new_state(batch_size))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, cache: K3Cache | None = None,
                past_key_values: K3Cache | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, return_dict: bool | None = None, **kwargs) -> CausalLMOutputWithPast:
        """input_ids [B, T]: the tokens after the cache's seq_len (all of them without a cache) -> logits [B, T, V].
        labels [B, T] (-100 ignored): the mean next-token cross-entropy, labels shifted here as transformers does.
        use_cache=True without a cache starts one; the returned cache has advanced by T tokens."""
        if kwargs.get("inputs_embeds") is not None:
            raise NotImplementedError("K3ForCausalLM takes input_ids only (inputs_embeds is not supported)")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise NotImplementedError(f"attention_mask with padding: {_PADDING_FIX}")
        k3_cache = _as_k3_cache(cache if cache is not None else past_key_values)
        if k3_cache is None and use_cache:
            k3_cache = self.new_cache(input_ids.shape[0])
        out = self.k3_model(input_ids, state=None if k3_cache is None else k3_cache.state)
        loss = None
        if labels is not None:
            logits = out.logits[:, :-1].float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        result = CausalLMOutputWithPast(loss=loss, logits=out.logits, **{CACHE_KWARG: k3_cache})
        return result.to_tuple() if return_dict is False else result

    def generate(self, *args, **kwargs):
        """GenerationMixin.generate, refusing beam search: the state's rows would need reordering per step."""
        gen = kwargs.get("generation_config") or self.generation_config
        if (kwargs.get("num_beams") or getattr(gen, "num_beams", 1) or 1) > 1:
            raise NotImplementedError("beam search (num_beams > 1) is not supported with k3's inference state; use "
                                      "greedy (do_sample=False) or sampling")
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, cache: K3Cache | None = None,
                                      past_key_values: K3Cache | None = None,
                                      attention_mask: torch.Tensor | None = None, use_cache: bool | None = True,
                                      **kwargs) -> dict:
        """Only the tokens the cache has not consumed, with the cache (started here on the first step)."""
        if kwargs.get("inputs_embeds") is not None:
            raise NotImplementedError("K3ForCausalLM.generate takes input_ids only (inputs_embeds is not supported)")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise NotImplementedError(f"generate() with a padded batch: {_PADDING_FIX}")
        k3_cache = _as_k3_cache(cache if cache is not None else past_key_values)
        if k3_cache is None and use_cache is not False:
            k3_cache = self.new_cache(input_ids.shape[0])
        new = input_ids if k3_cache is None else input_ids[:, k3_cache.seq_len:]
        return {"input_ids": new, CACHE_KWARG: k3_cache, "use_cache": use_cache}

    # ---------------------------------------------------------------------------------------------------------------
    # k3's checkpoint IO

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config: K3Config | None = None,
                        dtype=None, torch_dtype=None, device_map=None, subfolder: str = "", **kwargs) -> K3ForCausalLM:
        """Load a k3 release directory (a local path, or a Hub repo id fetched with huggingface_hub) with k3's
        loader (k3.model.checkpoint.load_model). dtype / torch_dtype: cast floating tensors (the fp32 ones stay
        fp32); None or "auto" keeps the stored dtypes. device_map: one device."""
        if model_args:
            raise TypeError(f"K3ForCausalLM.from_pretrained takes no positional model arguments, got {model_args!r}")
        unknown = sorted(set(kwargs) - set(_HUB_KWARGS) - set(_IGNORED_KWARGS))
        if unknown:
            raise TypeError(f"K3ForCausalLM.from_pretrained does not support {', '.join(unknown)}; it loads a k3 "
                            "release with k3's loader (supported: config, dtype / torch_dtype, device_map, subfolder "
                            "and the Hub download options)")
        path = Path(pretrained_model_name_or_path)
        if not path.is_dir():
            from huggingface_hub import snapshot_download

            hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs and k != "resume_download"}
            path = Path(snapshot_download(str(pretrained_model_name_or_path), **hub))
        path = path / subfolder if subfolder else path
        want = dtype if dtype is not None else torch_dtype
        want = None if want == "auto" else want
        k3, cfg = load_model(path, device=_device_of(device_map), dtype=want)
        loaded = K3Config.from_model_config(cfg, architectures=[cls.__name__])
        if config is not None and config.to_model_config() != cfg:
            diff = [f for f in MODEL_FIELDS if getattr(config, f) != getattr(loaded, f)]
            raise ValueError(f"the config passed differs from {path / 'config.json'} in {', '.join(diff)}; k3 builds "
                             "the model from config.json: edit it there (or pass no config)")
        qc = read_quantization_config(path)
        if qc is not None:
            loaded.quantization_config = qc
        seq_len = trained_seq_len(path)
        if seq_len is not None:
            loaded.max_position_embeddings = seq_len
        model = cls(loaded, k3_model=k3)
        if (path / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(path)
        return model.eval()

    def save_pretrained(self, save_directory, *, dtype=None, **kwargs) -> None:
        """Write a k3 release directory (k3.model.checkpoint.save_release: k3's tensor names and config.json, which
        `from_pretrained` and every k3 command load). Tokenizer files are the tokenizer's own save_pretrained."""
        unknown = sorted(set(kwargs) - {"safe_serialization", "is_main_process"})
        if unknown:
            raise TypeError(f"K3ForCausalLM.save_pretrained writes a k3 release; {', '.join(unknown)} not supported")
        if not kwargs.get("is_main_process", True):
            return
        gen = {k: v for k, v in self.generation_config.to_diff_dict().items() if k != "transformers_version"}
        extra = {k: getattr(self.config, k) for k in ("quantization_config", "max_position_embeddings")
                 if getattr(self.config, k, None) is not None}
        assert set(extra) <= set(HF_CONFIG_KEYS)
        save_release(save_directory, self.k3_model.state_dict(), self.k3_model.config, dtype=dtype,
                     generation_config=gen, **extra)


def register() -> None:
    """Register K3Config / K3ForCausalLM with AutoConfig and AutoModelForCausalLM (idempotent)."""
    AutoConfig.register(K3Config.model_type, K3Config, exist_ok=True)
    AutoModelForCausalLM.register(K3Config, K3ForCausalLM, exist_ok=True)


# the copy that `k3 export-hf` embeds runs under another package name and is registered through auto_map instead
if __name__ == "k3.model.hf":
    register()
