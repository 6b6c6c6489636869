"""Resumable training checkpoints: RUN_DIR/checkpoints/step-0000500/ (style.md section 5A).

    step-0000500/
      model.safetensors   the unwrapped model's state dict, dtypes unchanged (bit-exact)
      optim.pt            optimizer state_dict (torch.save; loaded with weights_only=True)
      train_state.json    step, tokens, best_val_loss, elapsed_s, saved_at + the loop's `extra` (human-readable)
      data.json           the data loader's state_dict (JSON)
      rng.pt              python `random`, numpy, torch CPU and CUDA generator states
      run_config.yaml     copy of RUN_DIR/run_config.yaml when present (each checkpoint describes its run)
      COMPLETE            written last: {"step", "files": {name: bytes}}; a directory without it is ignored

Atomicity: everything is written into `checkpoints/.tmp-step-0000500-<pid>/`, each file fsynced, COMPLETE last,
then the directory is renamed to its final name and the parent fsynced, so SIGKILL at any moment leaves either the
new complete checkpoint or none, and the previous ones untouched. Old checkpoints beyond `keep_last` are renamed to a
`.tmp-` name before deletion, so a kill mid-delete never leaves a half-deleted directory that looks complete.
One process (rank 0) owns a run directory's checkpoints: a new Checkpointer deletes stale `.tmp-*` directories.

Multi-process runs (k3.train.parallel.checkpoint) write the same directory with `dcp/` (torch.distributed.checkpoint:
`.metadata` and one `__R_0.distcp` per rank, holding {"model": state dict, "optim": optimizer state keyed by
parameter name}) in place of model.safetensors and optim.pt; COMPLETE then says "format": "dcp". `load_checkpoint`
reads either format into whole tensors on one process, and a multi-process run reshards either onto its ranks.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch

from k3.model.checkpoint import CheckpointError, fsync_dir, fsync_file, prepare_state_dict, replace_dir, write_text

from .config import CheckpointConfig

CHECKPOINT_DIR = "checkpoints"
COMPLETE = "COMPLETE"
FILES = ("model.safetensors", "optim.pt", "train_state.json", "data.json", "rng.pt")
DCP_FILES = ("dcp/.metadata", "train_state.json", "data.json", "rng.pt")  # the rank files are listed in COMPLETE
_STEP_RE = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    """Directory name of a step's checkpoint. Example: step_dir_name(500) == "step-0000500"."""
    return f"step-{step:07d}"


# --------------------------------------------------------------------------------------------------------------------
# RNG state


def capture_rng() -> dict:
    """Python `random`, numpy global, torch CPU and (when available) every CUDA generator state, torch.load-safe.

    Example: rng = capture_rng(); a = torch.rand(3); restore_rng(rng); torch.equal(torch.rand(3), a) is True
    """
    version, py_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(py_state), gauss],
        # numpy's MT19937 key is a uint32 array; stored as int64 so weights_only torch.load accepts it
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(rng: dict) -> None:
    """Restore generator states captured by `capture_rng` (CUDA states only for the devices present now)."""
    version, py_state, gauss = rng["python"]
    random.setstate((version, tuple(py_state), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"][: torch.cuda.device_count()])


# --------------------------------------------------------------------------------------------------------------------
# loading


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt JSON ({e}); load an older checkpoint") from None


def _torch_load(path: Path, map_location: Any) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt or unreadable ({type(e).__name__}: {str(e)[:200]}); "
                              "load an older checkpoint") from None


def read_dcp(path: str | Path) -> dict:
    """The whole state dict of a torch.distributed.checkpoint directory, read by this one process (no process group
    needed): nested as it was saved, sharded tensors reassembled."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict = {}
    try:  # as torch.distributed.checkpoint.format_utils.dcp_to_torch_save reads a checkpoint whole
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
            warnings.simplefilter("ignore", UserWarning)
            _load_state_dict(sd, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                             no_dist=True)
    except (RuntimeError, OSError, ValueError, EOFError) as e:
        raise CheckpointError(f"{path}: unreadable torch.distributed.checkpoint ({type(e).__name__}: "
                              f"{str(e)[:200]}); load an older checkpoint") from None
    return sd


def load_checkpoint(path: str | Path, map_location: Any = "cpu", tensors: bool = True) -> dict:
    """Load one training checkpoint directory (either format), checking it is complete and every file intact.

    Returns {"model_state": {name: Tensor}, "optim_state": dict, "data_state": dict, "train_state": dict,
    "rng": dict (for restore_rng), "path": Path, "format": "single" | "dcp"}; tensors=False leaves out
    model_state and optim_state (a multi-process run reads those into its shards itself).
    Example: ck = load_checkpoint("runs/x/checkpoints/step-0000500"); model.load_state_dict(ck["model_state"])
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: training checkpoint directory not found; list RUN_DIR/checkpoints/ or "
                              "use Checkpointer.latest()")
    marker = path / COMPLETE
    if not marker.is_file():
        raise CheckpointError(f"{marker}: missing, so the checkpoint is incomplete (its writer was killed); "
                              "load an older checkpoint or use Checkpointer.latest()")
    complete = _read_json(marker)
    sizes, fmt = complete.get("files", {}), complete.get("format", "single")
    for fname in sorted(set(DCP_FILES if fmt == "dcp" else FILES) | set(sizes)):
        f = path / fname
        if not f.is_file():
            raise CheckpointError(f"{f}: missing from the checkpoint; load an older checkpoint")
        if fname in sizes and f.stat().st_size != sizes[fname]:
            raise CheckpointError(f"{f}: {f.stat().st_size} bytes but {sizes[fname]} were written (truncated or "
                                  "corrupt); load an older checkpoint")
    out = {"data_state": _read_json(path / "data.json"), "train_state": _read_json(path / "train_state.json"),
           "rng": _torch_load(path / "rng.pt", "cpu"), "path": path, "format": fmt}
    if not tensors:
        return out
    if fmt == "dcp":
        sd = read_dcp(path / "dcp")
        return {"model_state": {k: v.to(map_location) for k, v in sd["model"].items()}, "optim_state": sd["optim"],
                **out}
    try:
        model_state = safetensors.torch.load_file(path / "model.safetensors", device=str(map_location))
    except (safetensors.SafetensorError, OSError) as e:
        raise CheckpointError(f"{path / 'model.safetensors'}: corrupt safetensors file ({e}); load an older "
                              "checkpoint") from None
    return {"model_state": model_state, "optim_state": _torch_load(path / "optim.pt", map_location), **out}


# --------------------------------------------------------------------------------------------------------------------
# writing


def _json_or_error(obj: Any, what: str) -> str:
    try:
        return json.dumps(obj, indent=2) + "\n"
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} must be JSON-serializable (plain int/float/str/list/dict): {e}") from None


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


class Checkpointer:
    """Writes, finds, prunes and loads RUN_DIR/checkpoints/step-N/ (see the module docstring for the layout).

    Example:
        ck = Checkpointer(cfg.ckpt, run_dir)
        ck.save(step, model_state=model.state_dict(), optim_state=opt.state_dict(),
                data_state=loader.state_dict(), tokens=tokens, best_val_loss=best, elapsed_s=t)
        state = ck.load()          # the newest complete checkpoint; CheckpointError when there is none
    """

    writer = True  # this process writes the directory's files; a multi-process run's rank 0 alone

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path):
        if cfg.keep_last < 1:
            raise CheckpointError(f"ckpt.keep_last must be >= 1, got {cfg.keep_last}; set ckpt.keep_last=1 or more")
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / CHECKPOINT_DIR
        if self.writer:
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob(".tmp-*"):  # left by a killed writer or deleter
                shutil.rmtree(stale, ignore_errors=True)

    def completed(self) -> list[Path]:
        """Complete checkpoint directories (COMPLETE marker present), oldest step first."""
        found = []
        for p in self.dir.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir() and (p / COMPLETE).is_file():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None; temporary and marker-less directories are ignored."""
        done = self.completed()
        return done[-1] if done else None

    def save(self, step: int, *, model_state: dict[str, torch.Tensor], optim_state: dict, data_state: dict,
             extra: dict | None = None, tokens: int | None = None, best_val_loss: float | None = None,
             elapsed_s: float | None = None) -> Path:
        """Write step `step`'s checkpoint atomically, prune to `keep_last`, and return its directory.

        model_state is written bit-exact (wrapper prefixes stripped, dtypes kept). tokens / best_val_loss /
        elapsed_s go to train_state.json, either as keywords or inside `extra` (JSON-serializable) — not both.
        Saving a step that already exists replaces it.
        """
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        train_state: dict[str, Any] = {"step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        for k, v in {"tokens": tokens, "best_val_loss": best_val_loss, "elapsed_s": elapsed_s}.items():
            if v is not None:
                train_state[k] = v
        clash = sorted(set(train_state) & set(extra or {}))
        if clash:
            raise CheckpointError(f"extra repeats train_state keys {clash}; pass each value once")
        train_state.update(extra or {})
        train_json = _json_or_error(train_state, "train_state (extra)")
        data_json = _json_or_error(data_state, "data_state (the loader's state_dict)")
        rng = capture_rng()

        final = self.dir / step_dir_name(step)
        tmp = self._make_tmp(final)
        try:
            files, fmt = self._write_tensors(tmp, model_state, optim_state)
            if not self.writer:
                self._finish(final)
                return final
            write_text(tmp / "train_state.json", train_json)
            write_text(tmp / "data.json", data_json)
            _torch_save(rng, tmp / "rng.pt")
            run_config = self.run_dir / "run_config.yaml"
            if run_config.is_file():
                shutil.copyfile(run_config, tmp / "run_config.yaml")
                fsync_file(tmp / "run_config.yaml")
            sizes = {f: (tmp / f).stat().st_size for f in (*files, "train_state.json", "data.json", "rng.pt")}
            complete = {"step": step, "files": sizes, **({"format": fmt} if fmt != "single" else {})}
            write_text(tmp / COMPLETE, json.dumps(complete, indent=2) + "\n")
            replace_dir(tmp, final)
        except BaseException:
            if self.writer:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        self._finish(final)
        return final

    # the steps a multi-process writer (k3.train.parallel.checkpoint) replaces
    def _make_tmp(self, final: Path) -> Path:
        """A fresh temporary directory beside `final`, renamed to it once complete."""
        tmp = self.dir / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def _write_tensors(self, tmp: Path, model_state: dict, optim_state: dict) -> tuple[list[str], str]:
        """Write the model and optimizer state into `tmp`; returns (the files written, the format name)."""
        safetensors.torch.save_file(prepare_state_dict(model_state), tmp / "model.safetensors",
                                    metadata={"format": "pt"})
        fsync_file(tmp / "model.safetensors")
        _torch_save(optim_state, tmp / "optim.pt")
        return ["model.safetensors", "optim.pt"], "single"

    def _finish(self, final: Path) -> None:
        """Called once `final` is complete (or, on a process that does not write, once its part is written)."""

    def _prune(self) -> None:
        for old in self.completed()[: -self.cfg.keep_last]:
            doomed = self.dir / f".tmp-del-{old.name}"
            os.rename(old, doomed)  # atomic: the step directory vanishes whole, then is deleted at leisure
            shutil.rmtree(doomed)
        fsync_dir(self.dir)

    restore_rng = staticmethod(restore_rng)  # so a loop holding only the Checkpointer can restore RNG state

    def load(self, path: str | Path | None = None, map_location: Any = "cpu") -> dict:
        """Load `path`, or the newest complete checkpoint when None (for --resume); see `load_checkpoint`."""
        if path is None:
            path = self.latest()
            if path is None:
                raise CheckpointError(f"{self.dir}: no complete checkpoint to resume from; drop --resume to start "
                                      "a new run, or pass the --out of the run you want to continue")
        return load_checkpoint(path, map_location)

