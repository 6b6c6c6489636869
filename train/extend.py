"""`k3 extend-context`: continue a pretrained K3 model at a longer sequence length, with its MLA layers switched
from RoPE to NoPE (the K3 recipe, architecture.md section 3) or kept on RoPE, optionally with a larger base.

The KDA layers carry position through their decaying recurrence, so the MLA layers need no positional signal of
their own; dropping RoPE there leaves nothing tied to the trained length (Cohere's RNoPE
study, Yang et al. 2025, "Rope to Nope and Back Again", found the NoPE full-attention layers of a hybrid extrapolate
best). Switching the
mode changes no parameter: the q/k rope slots keep their weights and are still scored, only unrotated, so the parent
loads strictly (tested).

This module is a recipe over `k3 pretrain`'s run (train/pretrain.py): the same loop, optimiser, checkpoints,
resume and progress display. What it adds: the parent's checks, the model config derived from the parent, the
run's provenance (k3_run.yaml names the parent) and, through the data section, the passkey mix
(data.passkey_fraction) over the long documents of the data source (the stdlib source packs whole files back to
back, so a 1,024-token window spans imports used far below and names defined far above).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3.model.checkpoint import CheckpointError
from k3.model.config import ConfigError

from .pretrain import PretrainResult, read_init
from .pretrain import run as pretrain_run

POSITIONS = ("nope", "rope")
# the ModelConfig fields a child may change relative to its parent: the position mode and the RoPE base
MAY_DIFFER = ("mla_position", "rope_theta")


def model_overrides(ckpt: str | Path, *, position: str, rope_theta: float | None) -> dict:
    """The child's model section: the parent's ModelConfig with `mla_position` and (rope only) `rope_theta` set.
    Raises CheckpointError / ConfigError before anything is written. Example:
    model_overrides("runs/tiny/final", position="rope", rope_theta=40000.0)["rope_theta"]  # 40000.0"""
    if position not in POSITIONS:
        raise ConfigError(f"--position {position!r}: use nope (the K3 recipe) or rope")
    if rope_theta is not None and position != "rope":
        raise ConfigError("--rope-theta sets the RoPE base, so it needs --position rope (NoPE has no base)")
    if rope_theta is not None and rope_theta <= 0:
        raise ConfigError(f"--rope-theta {rope_theta}: the RoPE base must be positive (e.g. 4x the parent's)")
    parent = read_init(ckpt)
    out = parent.cfg.to_dict()
    out["mla_position"] = position
    if rope_theta is not None:
        out["rope_theta"] = float(rope_theta)
    return out


def run(cfg: Any, *, ckpt: str | Path, run_dir: Path, resume: bool = False, position_forced: bool = False,
        run_config: dict | None = None, console=None) -> PretrainResult:
    """Extend `ckpt` (a release or training checkpoint) to cfg.data.seq_len with cfg.model's position mode.

    position_forced: the user set model.mla_position explicitly (--set), which allows a nope parent to train on
    as nope. Errors (ConfigError / CheckpointError, before anything is written): a quantized parent, a nope parent
    asked to become nope again, a sequence length not above the parent's trained length.
    """
    parent = read_init(ckpt)
    if parent.quantization is not None:
        raise CheckpointError(f"{ckpt}: a quantized release ({parent.quantization}) cannot be trained; extend the "
                              f"bf16 / fp32 release it was made from (its k3_run.yaml names it: "
                              f"parent_checkpoint), then quantize the extended one")
    mcfg, seq_len = cfg.model, cfg.data.seq_len
    if parent.cfg.mla_position == "nope" and mcfg.mla_position == "nope" and not position_forced:
        raise ConfigError(f"{ckpt}: its MLA layers are already nope (mla_position: nope), so --position nope changes "
                          f"nothing; to train it at --seq-len {seq_len} anyway, force the mode with "
                          f"--set model.mla_position=nope")
    trained = parent.trained_seq_len
    if trained is not None and seq_len <= trained:
        raise ConfigError(f"--seq-len {seq_len} is not above the {trained} tokens {ckpt} was trained at; extending "
                          f"needs a longer sequence, e.g. --seq-len {4 * trained}")
    rc = dict(run_config or {})
    rc["parent_checkpoint"] = str(ckpt)
    rc["extend"] = {"position": mcfg.mla_position, "rope_theta": mcfg.rope_theta, "seq_len": seq_len,
                    "parent_position": parent.cfg.mla_position, "parent_rope_theta": parent.cfg.rope_theta,
                    "parent_trained_seq_len": trained}
    if parent.run_info is not None:
        rc["parent_run"] = parent.run_info
    return pretrain_run(cfg, run_dir=run_dir, resume=resume, init=parent, run_config=rc, console=console,
                        init_may_differ=MAY_DIFFER, command=f"k3 extend-context {ckpt} --seq-len {seq_len}")
