"""Release checkpoints: a self-describing directory in the Hugging Face layout (style.md section 5B, rule 8).

    RELEASE_DIR/
      config.json              model_type "k3", architectures ["K3ForCausalLM"], torch_dtype, every ModelConfig
                               field, k3_format_version
      model.safetensors        metadata {"format": "pt"} (transformers rejects files without it), or
                               model-0000i-of-0000N.safetensors + model.safetensors.index.json when sharded
      generation_config.json   bos/eos/pad ids (from the tokenizer files), sampling defaults
      tokenizer.json, tokenizer_config.json, special_tokens_map.json   copied when a tokenizer is given
      k3_run.yaml              provenance: resolved config, git sha, parent checkpoint, ...

The directory is written next to its destination under a temporary name and renamed into place, so a killed writer
never leaves a half-written release, and replacing an existing release never loses both copies. Loading validates
every file and raises `CheckpointError` naming the file and the fix (a foreign, newer or corrupt checkpoint).

Quantized releases (k3.model.quant) add config.json["quantization_config"] and `<name>.scales` tensors; loading
validates the config and swaps in the quantized modules before the weights are assigned.

Public API: CheckpointError, save_release, load_release, read_release_config, read_quantization_config, load_model,
instantiate, load_state_into, validate_state_dict, prepare_state_dict.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
import yaml
from torch import nn

from .config import K3_FORMAT_VERSION, CheckpointError, ConfigError, ModelConfig
from .quant import apply_quantization, validate_quantization_config

MODEL_TYPE = "k3"
ARCHITECTURES = ["K3ForCausalLM"]
# Tensors that stay float32 in any export dtype: the router's QB bias is compared across experts at the 1e-3 level
# and the KDA decay parameters enter exp(); bf16 rounding of either changes routing / decay (architecture.md).
# Quantization `.scales` (k3.model.quant) multiply a whole group of weights: kept as the quantizer computed them.
FP32_TENSORS = ("e_score_correction_bias", "A_log", "dt_bias", "scales")
# Name components added by torch.compile (`_orig_mod`), activation checkpointing and FSDP1 wrappers; with DDP's
# leading `module.` they are never written (nanoGPT #325).
_WRAPPER_COMPONENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
# config.json keys that are not ModelConfig fields (HF bookkeeping); all other unknown keys are errors.
HF_CONFIG_KEYS = ("model_type", "architectures", "torch_dtype", "auto_map", "transformers_version",
                  "quantization_config", "max_position_embeddings")
SAFETENSORS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "max_new_tokens": 256}
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # HF's shard size; a smaller model is one model.safetensors


# --------------------------------------------------------------------------------------------------------------------
# state-dict preparation


def keeps_fp32(name: str) -> bool:
    """True for tensors that stay float32 in every export dtype (see FP32_TENSORS). Example: keeps_fp32("l.A_log")."""
    return any(name == s or name.endswith("." + s) for s in FP32_TENSORS)


def strip_wrapper_prefixes(name: str) -> str:
    """Remove wrapper prefixes: leading `module.` (DDP) and `_orig_mod` / activation-checkpoint / FSDP1 wrapper
    components anywhere (compiling a submodule puts `_orig_mod` mid-name). Example: "module._orig_mod.x.w" -> "x.w"."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_COMPONENTS]
    while len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and not dtype.is_floating_point:
            raise CheckpointError(f"export dtype must be a floating dtype, got {dtype}")
        return dtype
    dt = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise CheckpointError(f"unknown export dtype {dtype!r}; use 'float32', 'bfloat16' or 'float16'")
    return dt


def prepare_state_dict(state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype | str | None = None,
                       drop_tied: bool = False) -> dict[str, torch.Tensor]:
    """Make a state dict safe to write with safetensors: detached, on CPU, contiguous, no shared memory.

    Wrapper prefixes (`_orig_mod.`, `module.`) are stripped; floating tensors are cast to `dtype` when given, except
    FP32_TENSORS, which become float32. Tensors that are the same view of one storage (tied weights) keep one copy
    (the first name) when `drop_tied`, else each gets its own copy; partially overlapping views are always copied.

    Example: prepare_state_dict({"module.w": torch.ones(2, 3).t()})["w"].is_contiguous() is True
    """
    dt = _as_dtype(dtype)
    out: dict[str, torch.Tensor] = {}
    names: set[str] = set()
    first_view: set[tuple] = set()  # (storage ptr, offset, shape, stride, dtype) of kept tensors: exact aliases
    for raw_name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"state_dict[{raw_name!r}] is a {type(t).__name__}, not a tensor; "
                                  "pass model.state_dict() (extra values belong in run_info)")
        name = strip_wrapper_prefixes(raw_name)
        if name in names:
            raise CheckpointError(f"two state-dict entries map to {name!r} after stripping wrapper prefixes; "
                                  "save the unwrapped module's state_dict")
        names.add(name)
        t = t.detach()
        if drop_tied and t.numel() > 0:
            view = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if view in first_view:
                continue
            first_view.add(view)
        if t.is_floating_point() and keeps_fp32(name):
            t = t.float() if dt is not None else t
        elif t.is_floating_point() and dt is not None:
            t = t.to(dt)
        out[name] = t.to("cpu").contiguous()
    # safetensors refuses tensors that share a storage, and a view of a larger storage would be copied anyway:
    # give every tensor a storage of its own (a cast or device move above has usually done so already)
    seen: set[int] = set()
    for k, t in out.items():
        if t.numel() == 0:
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            out[k] = t.clone()
        seen.add(out[k].untyped_storage().data_ptr())
    return out


# --------------------------------------------------------------------------------------------------------------------
# atomic directory writes


def fsync_file(path: Path) -> None:
    """Flush a written file to stable storage (rename is atomic, but only durable once contents are synced)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (new names, renames) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: Path, text: str) -> None:
    """Write a text file and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished directory `tmp` to `final`, replacing an existing `final` without a moment with neither.

    Linux cannot rename a directory onto a non-empty one, so the old one is renamed aside first (a `.tmp-old-`
    name, which writers clean up on start), the new one renamed in, then the old one deleted.
    """
    fsync_dir(tmp)
    old = None
    if final.exists() or final.is_symlink():
        old = final.parent / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except OSError:
        if old is not None:
            os.rename(old, final)
        raise
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()


# --------------------------------------------------------------------------------------------------------------------
# save


def _write_safetensors(out: Path, sd: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    total = sum(t.numel() * t.element_size() for t in sd.values())
    if total <= max_shard_bytes:
        safetensors.torch.save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
        fsync_file(out / "model.safetensors")
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in sd.items():  # greedy in state-dict order; a tensor larger than a shard gets a shard of its own
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors.torch.save_file(shard, out / fname, metadata={"format": "pt"})
        fsync_file(out / fname)
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_text(out / SAFETENSORS_INDEX, json.dumps(index, indent=2) + "\n")


def _majority_dtype(sd: dict[str, torch.Tensor]) -> str:
    counts: dict[torch.dtype, int] = {}
    for t in sd.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    dt = max(counts, key=counts.__getitem__) if counts else torch.float32
    return str(dt).removeprefix("torch.")


def _token_name(v: Any) -> str | None:
    """tokenizer_config / special_tokens_map store a token as a string or as {"content": str, ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _special_token_ids(tok_dir: Path) -> dict[str, int]:
    """bos/eos/pad ids: token names from tokenizer_config.json (else special_tokens_map.json), ids from
    tokenizer.json (added_tokens, then the model vocab)."""
    names: dict[str, str] = {}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        p = tok_dir / fname
        if p.is_file():
            data = json.loads(p.read_text(encoding="utf-8"))
            for role in ("bos", "eos", "pad"):
                name = _token_name(data.get(f"{role}_token"))
                if name is not None:
                    names[role] = name
    if not names:
        return {}
    tok = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    model_vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(model_vocab, dict):
        vocab = {**model_vocab, **vocab}
    ids = {}
    for role, name in names.items():
        if name not in vocab:
            raise CheckpointError(f"{tok_dir}: {role}_token {name!r} is not in tokenizer.json; "
                                  "add it as a special token or fix tokenizer_config.json")
        ids[f"{role}_token_id"] = vocab[name]
    return ids


def _plain(x: Any) -> Any:
    """Convert provenance values to YAML-safe builtins (dataclasses, Paths, tuples, dtypes)."""
    import dataclasses

    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def save_release(out_dir: str | Path, state_dict: dict[str, torch.Tensor], cfg: ModelConfig, *,
                 tokenizer_dir: str | Path | None = None, run_info: dict | None = None,
                 dtype: torch.dtype | str | None = None, generation_config: dict | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, quantization_config: dict | None = None,
                 max_position_embeddings: int | None = None) -> Path:
    """Write a release checkpoint directory atomically and return its path.

    state_dict: the unwrapped model's tensors (wrapper prefixes are stripped anyway). dtype: export dtype for floating
    tensors ("bfloat16", torch.float32, ...; None keeps each tensor's dtype); FP32_TENSORS stay float32.
    tokenizer_dir: a directory holding tokenizer.json (+ optional tokenizer_config.json, special_tokens_map.json),
    or the tokenizer.json file itself. run_info: provenance for k3_run.yaml. generation_config: overrides of the
    sampling defaults. Tied weights (cfg.tie_word_embeddings) are written once. quantization_config: required
    exactly when `state_dict` is quantized (`.scales` tensors; k3.model.quant.quantize_state_dict makes both);
    written to config.json. Integer tensors (quantized weights) are never cast. max_position_embeddings: the
    sequence length the weights were trained at, written to config.json under Hugging Face's key (read back by
    `trained_seq_len`; not a ModelConfig field: nothing in the model is sized by it).

    Example: save_release("runs/x/final", model.state_dict(), cfg, dtype="bfloat16", run_info={"git_sha": sha})
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir} exists and is not a directory; choose another output path")
    try:
        cfg.validate()
    except ConfigError as e:
        raise CheckpointError(f"refusing to save an invalid ModelConfig: {e}") from None
    tok_files: dict[str, Path] = {}
    if tokenizer_dir is not None:
        tok = Path(tokenizer_dir)
        tok_dir = tok.parent if tok.is_file() else tok
        main = tok if tok.is_file() else tok / "tokenizer.json"
        if not main.is_file():
            raise CheckpointError(f"{main}: tokenizer file not found; pass the directory holding tokenizer.json "
                                  "(or the file itself) as tokenizer_dir")
        tok_files["tokenizer.json"] = main
        for fname in TOKENIZER_FILES[1:]:
            if (tok_dir / fname).is_file():
                tok_files[fname] = tok_dir / fname
    has_scales = any(k.endswith(".scales") for k in state_dict)
    if quantization_config is not None or has_scales:
        if quantization_config is None or not has_scales:
            raise CheckpointError("a quantized state dict ('.scales' tensors) needs quantization_config and vice "
                                  "versa; pass both from k3.model.quant.quantize_state_dict")
        quantization_config = validate_quantization_config(quantization_config, where="save_release")
    sd = prepare_state_dict(state_dict, dtype=dtype, drop_tied=cfg.tie_word_embeddings)
    dt = _as_dtype(dtype)
    torch_dtype = str(dt).removeprefix("torch.") if dt is not None else _majority_dtype(sd)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.parent.glob(f".tmp-{out_dir.name}-*"):  # left by a killed writer of this release
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        config = {"model_type": MODEL_TYPE, "architectures": list(ARCHITECTURES), "torch_dtype": torch_dtype,
                  **cfg.to_dict(), "k3_format_version": K3_FORMAT_VERSION}
        if quantization_config is not None:
            config["quantization_config"] = quantization_config
        if max_position_embeddings is not None:
            config["max_position_embeddings"] = int(max_position_embeddings)
        write_text(tmp / "config.json", json.dumps(config, indent=2) + "\n")
        _write_safetensors(tmp, sd, max_shard_bytes)
        for fname, src in tok_files.items():
            shutil.copyfile(src, tmp / fname)
            fsync_file(tmp / fname)
        gen = {**GENERATION_DEFAULTS, **(generation_config or {})}
        if tok_files and not {"bos_token_id", "eos_token_id", "pad_token_id"} <= set(gen):
            gen = {**_special_token_ids(tmp), **gen}  # ids passed in generation_config win
        write_text(tmp / "generation_config.json", json.dumps(gen, indent=2) + "\n")
        run = {"k3_format_version": K3_FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               **_plain(run_info or {})}
        write_text(tmp / "k3_run.yaml", yaml.safe_dump(run, sort_keys=False))
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# --------------------------------------------------------------------------------------------------------------------
# load


def _load_safetensors(path: Path, device: str | torch.device, mmap: bool) -> dict[str, torch.Tensor]:
    try:
        if mmap:
            return safetensors.torch.load_file(path, device=str(device))
        sd = safetensors.torch.load(path.read_bytes())
        return {k: v.to(device) for k, v in sd.items()}
    except (safetensors.SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e}); re-export the checkpoint or "
                              "restore the file from its source") from e


def read_release_config(path: str | Path) -> ModelConfig:
    """Read and validate RELEASE_DIR/config.json without touching the weights. Example: read_release_config(d).d_model"""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint directory not found; pass a release directory such as "
                              "RUN_DIR/final")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; a k3 checkpoint is a directory holding config.json and "
                              "model.safetensors (pass the directory, not a file inside it)")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        hint = "pass a k3 release directory (RUN_DIR/final)"
        if (path / "final" / "config.json").is_file():
            hint = f"did you mean {path / 'final'}?"
        elif (path / "train_state.json").is_file():
            hint = "this is a training checkpoint; resume it with --resume, or pass RUN_DIR/final"
        raise CheckpointError(f"{cfg_path}: missing config.json; {hint}")
    try:
        data = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e}); the file is corrupt, re-export the checkpoint") \
            from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object, got {type(data).__name__}; re-export the checkpoint")
    if data.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{cfg_path}: model_type is {data.get('model_type')!r}, not {MODEL_TYPE!r}: this is "
                              "not a k3 checkpoint (foreign checkpoint); convert it to the k3 format first")
    version = data.get("k3_format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(f"{cfg_path}: k3_format_version is missing or not an integer ({version!r}); the file "
                              "was not written by k3, re-export the checkpoint")
    if version > K3_FORMAT_VERSION:
        raise CheckpointError(f"{cfg_path}: k3_format_version {version} is newer than this k3 supports "
                              f"({K3_FORMAT_VERSION}); upgrade k3 to load it")
    fields = {k: v for k, v in data.items() if k not in HF_CONFIG_KEYS}
    try:
        return ModelConfig.from_dict(fields)
    except ConfigError as e:
        raise CheckpointError(f"{cfg_path}: {e}; fix or remove the key in config.json (or upgrade k3 if the "
                              "checkpoint is from a newer version)") from None


def read_quantization_config(path: str | Path) -> dict | None:
    """RELEASE_DIR/config.json["quantization_config"], validated (k3.model.quant), or None for an unquantized
    release. Example: read_quantization_config(d)["format"]  # "w4a8" """
    read_release_config(path)  # the directory and config.json checks, with their messages
    cfg_path = Path(path) / "config.json"
    qc = json.loads(cfg_path.read_text(encoding="utf-8")).get("quantization_config")
    if qc is None:
        return None
    return validate_quantization_config(qc, where=str(cfg_path))


def trained_seq_len(path: str | Path) -> int | None:
    """The sequence length a release was trained on: config.json's max_position_embeddings where save_release wrote
    it, else data.seq_len of the resolved config its k3_run.yaml records (a quantized release: its parent run's),
    else None. Not a ModelConfig field (a train-only setting). Example: trained_seq_len("runs/tiny/final")  # 256"""
    cfg_path = Path(path) / "config.json"
    if cfg_path.is_file():
        try:
            recorded = json.loads(cfg_path.read_text(encoding="utf-8")).get("max_position_embeddings")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            recorded = None  # read_release_config reports a damaged config.json with its own message
        if isinstance(recorded, int) and not isinstance(recorded, bool):
            return recorded
    run_path = Path(path) / "k3_run.yaml"
    if not run_path.is_file():
        return None
    try:
        run = yaml.safe_load(run_path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{run_path}: not readable YAML ({e}); restore it or re-export the checkpoint") from None
    while isinstance(run, dict):
        seq_len = ((run.get("config") or {}).get("data") or {}).get("seq_len")
        if isinstance(seq_len, int) and not isinstance(seq_len, bool):
            return seq_len
        run = run.get("parent_run")
    return None


def load_release(path: str | Path, *, device: str | torch.device = "cpu",
                 mmap: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a release directory: (ModelConfig, state dict). Tied aliases are absent (see `instantiate`).
    A quantized release's quantization_config is validated (read it with `read_quantization_config`).

    mmap=True maps the safetensors files (tensors are paged in on use); mmap=False reads them into memory first.

    Example: cfg, sd = load_release("runs/x/final"); sd["model.embed_tokens.weight"].shape  # [V, D]
    """
    path = Path(path)
    cfg = read_release_config(path)
    read_quantization_config(path)
    single, index = path / "model.safetensors", path / SAFETENSORS_INDEX
    if single.exists() and index.exists():
        raise CheckpointError(f"{path}: holds both model.safetensors and {SAFETENSORS_INDEX}; remove the stale one")
    if single.exists():
        return cfg, _load_safetensors(single, device, mmap)
    if not index.exists():
        raise CheckpointError(f"{single}: missing weights (neither model.safetensors nor {SAFETENSORS_INDEX}); "
                              "the export did not finish, re-export the checkpoint")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        assert isinstance(weight_map, dict)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AssertionError) as e:
        raise CheckpointError(f"{index}: invalid index ({type(e).__name__}: {e}); expected "
                              '{"weight_map": {tensor name: shard file}}; re-export the checkpoint') from None
    sd: dict[str, torch.Tensor] = {}
    for shard in dict.fromkeys(weight_map.values()):
        shard_path = path / shard
        if not shard_path.is_file():
            raise CheckpointError(f"{shard_path}: shard listed in {index.name} is missing; copy the complete "
                                  "checkpoint directory")
        part = _load_safetensors(shard_path, device, mmap)
        want = {k for k, v in weight_map.items() if v == shard}
        if set(part) != want:
            diff = sorted(want ^ set(part))[:5]
            raise CheckpointError(f"{shard_path}: tensors disagree with {index.name} (e.g. {diff}); the index and "
                                  "the shards come from different exports, re-export the checkpoint")
        sd.update(part)
    return cfg, {k: sd[k] for k in weight_map}


# --------------------------------------------------------------------------------------------------------------------
# model instantiation


def _alias_groups(model: nn.Module) -> list[list[str]]:
    """Names of state-dict entries that are one tensor object (tied parameters or buffers), grouped."""
    groups: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _get_tensor(model: nn.Module, name: str) -> torch.Tensor:
    mod_name, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(mod_name), leaf)


def _few(names: list[str] | set[str], n: int = 5) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def validate_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError listing missing, unexpected and shape-mismatched keys of `state_dict` for `model`.

    A key absent from `state_dict` is fine when a tied alias of it is present (tied embeddings are saved once).
    Example: validate_state_dict(nn.Linear(2, 3), {"weight": torch.zeros(3, 2), "bias": torch.zeros(3)})
    """
    expected = model.state_dict(keep_vars=True)
    present = set(state_dict)
    covered = set(present)
    for group in _alias_groups(model):
        if present & set(group):
            covered |= set(group)
    missing = [k for k in expected if k not in covered]
    unexpected = [k for k in state_dict if k not in expected]
    shapes = [f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(expected[k].shape)}"
              for k in state_dict if k in expected and state_dict[k].shape != expected[k].shape]
    problems = []
    if missing:
        problems.append(f"missing keys: {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_few(unexpected)}")
    if shapes:
        problems.append(f"shape mismatches: {'; '.join(shapes[:5])}" + (f" ({len(shapes)} in all)"
                                                                         if len(shapes) > 5 else ""))
    if problems:
        raise CheckpointError("state dict does not match the model (" + " | ".join(problems) + "); the checkpoint "
                              "was written by a different architecture/config or k3 version")


def load_state_into(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """Copy a checkpoint state dict into an existing `model` strictly (e.g. `--init`), validating it first.

    Unlike `model.load_state_dict`, a tied alias absent from the checkpoint (saved once) is accepted, and errors
    list the mismatched names. Wrapper prefixes on `model` (torch.compile) are looked through.
    Example: load_state_into(model, load_release("runs/x/final")[1])
    """
    target = getattr(model, "_orig_mod", model)
    validate_state_dict(target, state_dict)
    sd = dict(state_dict)
    for group in _alias_groups(target):
        src = next(k for k in group if k in sd)
        for k in group:
            sd.setdefault(k, sd[src])
    target.load_state_dict(sd, strict=True)
    return model


def instantiate(build: Callable[[], nn.Module], state_dict: dict[str, torch.Tensor], *,
                device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None) -> nn.Module:
    """Build a module with `build()` and load `state_dict` into it strictly, without a second copy of the weights.

    The module is built on the meta device and the checkpoint tensors are assigned (gpt-fast's meta init +
    `assign=True`), unless it has non-persistent buffers, whose values only its constructor knows: then it is built
    on `device`. Tied parameters are re-tied after assignment. dtype casts floating tensors except FP32_TENSORS.

    Example: m = instantiate(lambda: nn.Linear(2, 3), {"weight": w_32, "bias": b_3})
    """
    dt = _as_dtype(dtype)
    with torch.device("meta"):
        model = build()
    non_persistent = {n for n, _ in model.named_buffers()} - set(model.state_dict())
    if non_persistent:
        with torch.device(device):
            model = build()
    validate_state_dict(model, state_dict)
    sd = {}
    for k, t in state_dict.items():
        if t.is_floating_point() and dt is not None:
            t = t.float() if keeps_fp32(k) else t.to(dt)
        sd[k] = t.to(device)
    groups = _alias_groups(model)
    for group in groups:  # give absent aliases the present tensor so the strict load sees every key
        src = next(k for k in group if k in sd)
        for k in group:
            sd.setdefault(k, sd[src])
    model.load_state_dict(sd, strict=True, assign=True)
    for group in groups:  # assign=True gave each alias its own tensor object; make them one object again
        first = _get_tensor(model, group[0])
        for k in group[1:]:
            mod_name, _, leaf = k.rpartition(".")
            setattr(model.get_submodule(mod_name), leaf, first)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"tensors left on the meta device after loading: {_few(left)}")
    return model


def load_model(path: str | Path, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | str | None = None) -> tuple[nn.Module, ModelConfig]:
    """Load a release directory into a `K3Model` in eval mode: (model, cfg). A quantized release gets its
    quantized expert modules (k3.model.quant.apply_quantization) before the weights are assigned; dtype casts only
    floating tensors (quantized weights stay integer, their scales fp32).

    Example: model, cfg = load_model("runs/x/final", device="cuda", dtype="bfloat16")
    """
    from .transformer import K3Model  # imported here: checkpoint IO must not require the model code to import

    cfg, sd = load_release(path, device="cpu")
    qc = read_quantization_config(path)

    def build() -> nn.Module:
        if qc is None:
            return K3Model(cfg)
        return apply_quantization(K3Model(cfg), qc)

    try:
        model = instantiate(build, sd, device=device, dtype=dtype)
    except CheckpointError as e:
        raise CheckpointError(f"{Path(path)}: {e}") from None
    return model.eval(), cfg
