"""Training checkpoints of a multi-process run: torch.distributed.checkpoint (DCP) inside the usual step directory.

Every rank writes its own shards of the model and optimizer state into `dcp/` of one temporary directory (its name
chosen by rank 0 and broadcast); rank 0 then writes train_state.json, data.json, rng.pt, run_config.yaml and
COMPLETE and renames the directory into place, exactly as the one-process Checkpointer does, so a kill at any moment
leaves the new checkpoint whole or absent (train/checkpoint.py). Optimizer state is keyed by parameter name, so it
does not depend on how the parameters are sharded.

Loading reshards: a DCP checkpoint of any world size loads onto this run's shards (DCP reads the pieces each rank
needs), and a one-process checkpoint (model.safetensors, optim.pt) is read whole and cut into this rank's shards.
A one-process run reads a DCP checkpoint whole (`k3.train.checkpoint.load_checkpoint`). rng.pt holds rank 0's
generators; every rank restores them (the data order lives in data.json, not in a generator).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from k3.model.checkpoint import CheckpointError

from ..checkpoint import Checkpointer, load_checkpoint
from ..config import CheckpointConfig
from .runtime import Distributed


def named_optim_state(model: nn.Module, opt: torch.optim.Optimizer, osd: dict) -> dict:
    """An optimizer state_dict whose parameter ids (0.. over opt.param_groups in order) are replaced by the
    parameters' names in `model`: the layout DCP saves and torch's load_state_dict accepts (it matches by position)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    return {"state": {order[k]: v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [order[k] for k in g["params"]]} for g in osd["param_groups"]]}


@torch.no_grad()
def init_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (momentum, moments) with a step of lr 0 on zero gradients, so that DCP has
    tensors of the right shards to load into; parameters are unchanged (decay x 1, update x 0). Collective under
    FSDP2 (Muon's gather): every rank calls it."""
    if len(opt.state):
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


def _shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor cut like `like` (a DTensor: this rank's shard, no communication) or moved to its device."""
    full = full.to(like.device)
    if type(like).__name__ != "DTensor":
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model state dict on rank 0's CPU (empty on the other ranks), for the release final/; collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class DistributedCheckpointer(Checkpointer):
    """Checkpointer for a multi-process run (module docstring): every rank calls save / load / latest together.

    Example: ck = DistributedCheckpointer(cfg.ckpt, run_dir, d, model, optimizer); ck.save(step, model_state=
    model.state_dict(), optim_state=optimizer.state_dict(), data_state=loader.state_dict())
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, d: Distributed, model: nn.Module,
                 optimizer: torch.optim.Optimizer):
        self.d, self.model, self.opt = d, model, optimizer
        super().__init__(cfg, run_dir)
        d.barrier()  # rank 0 made the directory and cleared stale temporaries before any rank looks inside

    @property
    def writer(self) -> bool:
        return self.d.is_main

    def _make_tmp(self, final: Path) -> Path:
        return Path(self.d.broadcast(str(super()._make_tmp(final)) if self.d.is_main else None))

    def _write_tensors(self, tmp: Path, model_state: dict, optim_state: dict) -> tuple[list[str], str]:
        import torch.distributed.checkpoint as dcp

        state = {"model": model_state, "optim": named_optim_state(self.model, self.opt, optim_state)}
        self.d.collective("checkpoint save", lambda: dcp.save(state, checkpoint_id=str(tmp / "dcp")))
        files = sorted(f"dcp/{f}" for f in os.listdir(tmp / "dcp")) if self.d.is_main else []
        return files, "dcp"

    def _finish(self, final: Path) -> None:
        self.d.barrier()  # no rank goes on (or looks for the checkpoint) before rank 0 renamed it into place

    def load(self, path: str | Path | None = None, map_location: Any = "cpu") -> dict:
        """The checkpoint at `path` (None: the newest complete one) with model_state and optim_state as this
        rank's shards (DTensors), ready for model.load_state_dict / optimizer.load_state_dict."""
        if path is None:
            path = self.latest()
            if path is None:
                raise CheckpointError(f"{self.dir}: no complete checkpoint to resume from; drop --resume to start "
                                      "a new run, or pass the --out of the run you want to continue")
        path = Path(path)
        ck = load_checkpoint(path, tensors=False)
        model_sd = self.model.state_dict()
        if ck["format"] == "dcp":
            import torch.distributed.checkpoint as dcp

            init_optimizer_state(self.model, self.opt)
            # templates of this run's shards; DCP reads into them in place (tensors) or replaces the values
            state = {"model": model_sd, "optim": named_optim_state(self.model, self.opt, self.opt.state_dict())}
            self.d.collective("checkpoint load", lambda: dcp.load(state, checkpoint_id=str(path / "dcp")))
            return {**ck, "model_state": state["model"], "optim_state": state["optim"]}
        whole = load_checkpoint(path)
        missing = sorted(set(model_sd) - set(whole["model_state"]))
        if missing:
            raise CheckpointError(f"{path}: the checkpoint lacks {len(missing)} tensors of this model, e.g. "
                                  f"{missing[:3]}; resume with the model config it was written with")
        params = [p for g in self.opt.param_groups for p in g["params"]]
        osd = whole["optim_state"]
        saved_ids = [k for g in osd["param_groups"] for k in g["params"]]
        if len(saved_ids) != len(params):
            raise CheckpointError(f"{path}: optimizer state for {len(saved_ids)} parameters, this optimizer has "
                                  f"{len(params)}; the model or optim config changed since it was written")
        by_id = dict(zip(saved_ids, params, strict=True))
        state = {k: {n: _shard_like(v, by_id[k]) if torch.is_tensor(v) and v.shape == by_id[k].shape else v
                     for n, v in s.items()} for k, s in osd["state"].items()}
        return {**ck, "model_state": {k: _shard_like(whole["model_state"][k], v) for k, v in model_sd.items()},
                "optim_state": {"state": state, "param_groups": osd["param_groups"]}}
