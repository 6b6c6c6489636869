"""K3Config: the one root config every command resolves, and its loader.

Precedence: dataclass defaults < `--preset NAME` (package YAML) < `--config FILE` (repeatable, merged in order) <
a command's flag shortcuts (e.g. `k3 serve --port`) < `--set a.b=value` (repeatable). Unknown keys and wrong types are errors that name the key and
the close matches. A preset names its model (`model: k3-tiny`) or inlines it; an inline mapping may start from a
named model with `preset: k3-tiny` and override fields.
"""

from __future__ import annotations

import copy
import importlib.resources
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from k3.kernels.config import KernelConfig
from k3.model.config import ConfigError, ModelConfig, config_from_dict, config_to_dict
from k3.serve.config import ServeConfig
from k3.train.config import (
    CheckpointConfig,
    DataConfig,
    DistillConfig,
    OptimConfig,
    ParallelConfig,
    QuantizeConfig,
    TrainConfig,
)


@dataclass(kw_only=True, slots=True)
class K3Config:
    """Root config. Sections a command does not use stay None."""

    model: ModelConfig | None = None  # architecture (travels with weights as config.json)
    data: DataConfig | None = None  # text source, tokenizer, sequence length
    optim: OptimConfig | None = None  # optimizer, schedule, QK-Clip, router balance
    train: TrainConfig | None = None  # the train loop
    ckpt: CheckpointConfig | None = None  # training checkpoints
    kernels: KernelConfig | None = None  # kernel backend and numerics (KDA backward, recompute, fp32 dots)
    serve: ServeConfig | None = None  # the serving engine and HTTP server (`k3 serve`)
    quantize: QuantizeConfig | None = None  # format, modules, mode and calibration of `k3 quantize`
    distill: DistillConfig | None = None  # loss, routing and sampling of `k3 distill`
    parallel: ParallelConfig | None = None  # dp x ep x cp process layout under torchrun (k3 pretrain: data parallelism)


SECTIONS = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig,
            "ckpt": CheckpointConfig, "kernels": KernelConfig, "serve": ServeConfig, "quantize": QuantizeConfig,
            "distill": DistillConfig, "parallel": ParallelConfig}
# the sections each command resolves (the others stay None); its presets live in presets/<command>/
COMMAND_SECTIONS = {"pretrain": ("model", "data", "optim", "train", "ckpt", "kernels", "parallel"),
                    "serve": ("serve", "kernels"),
                    "generate": ("kernels",), "extend-context": ("model", "data", "optim", "train", "ckpt", "kernels"),
                    "quantize": ("quantize", "data", "optim", "train", "ckpt", "kernels"),
                    "distill": ("distill", "optim", "train", "ckpt", "kernels")}
PRESET_KINDS = {"extend-context": "extend"}  # presets/<kind>/ of a command whose folder is not named after it


def _presets_root():
    return importlib.resources.files("k3.cli") / "presets"


def list_presets(kind: str) -> list[str]:
    """Names of the presets of one kind ("model", "pretrain", ...)."""
    d = _presets_root() / kind
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".yaml")) if d.is_dir() else []


def read_preset(kind: str, name: str) -> dict:
    """The raw mapping of preset `kind/name.yaml`; ConfigError listing the available names if it is missing."""
    f = _presets_root() / kind / f"{name}.yaml"
    if not f.is_file():
        raise ConfigError(f"unknown {kind} preset '{name}'; available: {', '.join(list_presets(kind)) or 'none'}")
    data = yaml.safe_load(f.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"preset {kind}/{name}.yaml must be a mapping")
    return data


def load_model_config(name: str) -> ModelConfig:
    """ModelConfig of a named model preset, e.g. load_model_config("k3-tiny")."""
    return ModelConfig.from_dict(read_preset("model", name))


def deep_merge(base: dict, over: dict) -> dict:
    """Recursive merge: mappings merge key by key, everything else is replaced."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def read_yaml_file(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections (model:, train:, ...)")
    return data


def parse_set(expr: str) -> dict:
    """'train.max_steps=5' -> {'train': {'max_steps': 5}} (the value parsed with yaml.safe_load, coerced later)."""
    if "=" not in expr:
        raise ConfigError(f"--set expects section.key=value, got '{expr}'")
    key, raw = expr.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if len(parts) < 2:
        raise ConfigError(f"--set key must be section.key (e.g. train.max_steps=100), got '{key}'")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    out: dict = {}
    cur = out
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return out


def _resolve_model(raw: Any) -> dict:
    """A model entry may be a preset name, or a mapping optionally starting from `preset: NAME`."""
    if isinstance(raw, str):
        return read_preset("model", raw)
    if isinstance(raw, dict):
        raw = dict(raw)
        base = raw.pop("preset", None)
        return deep_merge(read_preset("model", base), raw) if base else raw
    raise ConfigError(f"model: expected a preset name or a mapping, got {raw!r}")


def resolve_config(command: str, *, preset: str | None, config_files: list[str] | None = None,
                   sets: list[str] | None = None, overrides: dict | None = None,
                   sections: tuple[str, ...] | None = None) -> K3Config:
    """Build the K3Config for `command` from preset, files, flag shortcuts and --set overrides (module docstring).

    overrides: {section: {key: value}} a command's flags stand for, merged after the files and before --set.
    sections: the sections to build (default COMMAND_SECTIONS[command]); a section a file or --set names is built
    too. Example: resolve_config("serve", preset="default", sets=["serve.max_num_seqs=32"]).serve.max_num_seqs == 32
    """
    sections = COMMAND_SECTIONS.get(command, tuple(SECTIONS)) if sections is None else sections
    allowed = set(sections) if command in COMMAND_SECTIONS else set(SECTIONS)
    raw: dict = {s: {} for s in sections}
    if preset is not None:
        raw = deep_merge(raw, read_preset(PRESET_KINDS.get(command, command), preset))
    for f in config_files or []:
        raw = deep_merge(raw, read_yaml_file(f))
    if overrides:
        raw = deep_merge(raw, overrides)
    # a named model is resolved before --set so that `--set model.d_model=...` overrides the preset's value
    m = raw.get("model")
    if isinstance(m, str) or (isinstance(m, dict) and "preset" in m):
        raw["model"] = _resolve_model(m)
    for s in sets or []:
        over = parse_set(s)
        if "model" in over and isinstance(over["model"], dict) and "preset" in over["model"]:
            raw["model"] = _resolve_model(over.pop("model"))
        raw = deep_merge(raw, over)
    unknown = [k for k in raw if k not in SECTIONS]
    if unknown:
        import difflib
        close = difflib.get_close_matches(unknown[0], list(SECTIONS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; sections: {', '.join(SECTIONS)}"
        raise ConfigError(f"unknown config section '{unknown[0]}'{hint}")
    foreign = [k for k in raw if k not in allowed]
    if foreign:
        raise ConfigError(f"section '{foreign[0]}' is not used by `k3 {command}` (it reads {', '.join(sorted(allowed))})")
    cfg = config_from_dict(K3Config, raw)
    if cfg.model is not None:
        cfg.model.validate()
    if cfg.kernels is not None:
        try:
            cfg.kernels.validate()
        except ValueError as e:
            raise ConfigError(f"kernels: {e}") from None
    if cfg.parallel is not None:  # the world size is checked by the launcher, which knows it
        try:
            cfg.parallel.validate(num_experts=cfg.model.num_experts if cfg.model is not None else None,
                                  seq_len=cfg.data.seq_len if cfg.data is not None else None)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return cfg


def apply_kernels(cfg: K3Config) -> dict:
    """Apply the config's kernel section for this process (k3.kernels.configure: the environment variables K3_KERNELS,
    K3_KDA_BWD, K3_KDA_RECOMPUTE, K3_KDA_FP32_DOTS override its fields) and return what to record in
    run_config.yaml: {"effective": the settings the kernels run with, "env_overrides": {variable: value}}."""
    from k3.kernels import configure

    try:
        effective, env = configure(cfg.kernels if cfg.kernels is not None else KernelConfig())
    except ValueError as e:
        raise ConfigError(f"kernels: {e}") from None
    return {"effective": config_to_dict(effective), "env_overrides": env}


def resolve_device(name: str, flag: str) -> str:
    """A command's device flag checked against this torch build and machine: "auto" -> "cuda" when a GPU is usable,
    else "cpu"; "cpu", "cuda" and "cuda:N" are returned as given if they can run, else a ConfigError names the flag,
    the reason (a CPU-only torch build, no visible GPU) and the fix, instead of torch's traceback from deep inside
    the model's loading. Example: resolve_device("auto", "--device") -> "cpu" on a machine without a GPU."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if not re.fullmatch(r"cuda(:\d+)?", name):
        raise ConfigError(f"{flag} {name!r}: unknown device; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        if torch.version.cuda is None and torch.version.hip is None:
            raise ConfigError(f"{flag} {name}: this torch ({torch.__version__}) is a CPU-only build; use {flag} cpu "
                              f"(or auto), or install a CUDA build of torch: https://pytorch.org/get-started/locally/")
        raise ConfigError(f"{flag} {name}: torch {torch.__version__} sees no GPU (no driver, or CUDA_VISIBLE_DEVICES "
                          f"hides them all); use {flag} cpu or auto")
    index = int(name.partition(":")[2] or 0)
    if index >= (count := torch.cuda.device_count()):
        raise ConfigError(f"{flag} {name}: this machine shows {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return name


def config_dict(cfg: K3Config) -> dict:
    """Plain dict of the resolved config (None sections dropped), for run_config.yaml."""
    return {k: v for k, v in config_to_dict(cfg).items() if v is not None}


def git_sha() -> str | None:
    """The repository's commit when k3 runs from a checkout (None when installed elsewhere)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment_info() -> dict:
    """Versions recorded in every run_config.yaml (kernels break across Triton minors: fla #196, #734)."""
    import torch

    info = {"python": platform.python_version(), "torch": str(torch.__version__), "platform": platform.platform(),
            "argv": list(sys.argv), "git_sha": git_sha(), "cwd": os.getcwd()}
    try:
        import triton

        info["triton"] = str(triton.__version__)
    except ImportError:
        info["triton"] = None
    info["cuda"] = torch.version.cuda if torch.cuda.is_available() else None
    # how the CPU threads wait and share (k3cli/host.py chooses the wait at start): CPU timings depend on both
    info["threads"] = torch.get_num_threads()
    info["omp_wait"] = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    return info


def resume_config_files(run_dir: Path, files: list[str], resume: bool) -> tuple[list[str], bool]:
    """--resume: the run's saved resolved config (run_config.yaml's `config`) first, so that the resumed run trains
    the same thing, then `files`. Returns (config files, whether the saved config replaces the preset)."""
    saved = Path(run_dir) / "run_config.yaml"
    if not (resume and saved.is_file()):
        return files, False
    prev = yaml.safe_load(saved.read_text()) or {}
    tmp = Path(run_dir) / ".resume_config.yaml"
    tmp.write_text(yaml.safe_dump(prev.get("config", {})))
    return [str(tmp), *files], True
