"""FSDP2 over the data-parallel mesh: which modules are sharding units, in which order, with which precision.

K3's decoder layers have no forward of their own (the backbone calls each mixer and MLP between its AttnRes
mixtures), so the units are the modules that run as calls: every layer's mixer (KDA or MLA) and MLP (dense or
LatentMoE), then the MTP block's mixer and MLP, each its own `fully_shard` in that fixed order, and last the root,
which holds the rest (embedding, LM head, norms, AttnRes pseudo-queries, the MTP's input projection: parameters the
backbone reads outside those calls). A unit's parameters are all-gathered just before its call and freed after it,
and its gradients are reduce-scattered in the backward. Parameters stay sharded along dim 0 (`Shard(0)`).
`plain_head_weight` (the LM head's weight, which the fused loss takes before the forward) is registered as a
forward of the root, so that it returns the unsharded weight. Under expert parallelism (a 1-D mesh named "ep", or
the 2-D ("dp", "ep") mesh) the routed experts are first sharded by expert (k3.train.parallel.ep) and FSDP2 ignores
them; everything else is FSDP2-sharded over all ranks (the 2-D mesh flattened, rank order).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from k3.model.config import ConfigError
from k3.model.transformer import K3Model

from ..config import DataConfig, TrainConfig


def fsdp_units(model: K3Model) -> list[nn.Module]:
    """The modules sharded as units, in application order: layer 0's mixer, its MLP, layer 1's mixer, ..., then the
    MTP block's mixer and MLP (the root comes after them)."""
    units = [m for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]
    if model.mtp is not None:
        units += [model.mtp.self_attn, model.mtp.mlp]
    return units


def shard_model(model: K3Model, mesh, device: torch.device) -> K3Model:
    """Apply FSDP2 in place: `fully_shard` on every unit of `fsdp_units`, then on the root.

    On CUDA each unit computes in bf16 and reduces gradients in fp32 (MixedPrecisionPolicy; the sharded parameters
    and the optimizer state stay fp32); on the CPU everything stays fp32 (bf16 matmuls are far slower there).
    Example: shard_model(model, d.mesh, d.device)  # model.model.layers[0].self_attn.q_proj.weight is a DTensor
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda"
          else MixedPrecisionPolicy())
    # LatentMoE returns a view ([N, D] -> [B, T, D]); FSDP2 warns because an in-place op on it would skip the
    # backward's all-gather, but the backbone only ever adds sub-layer outputs out of place
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    ignored = None
    if "ep" in (mesh.mesh_dim_names or ()):
        # expert parallelism: each rank keeps its shard of whole experts (k3.train.parallel.ep), so FSDP2 leaves
        # them alone; their gradients already sum every rank's tokens (the all_to_all's backward, and over the dp
        # groups the reduce-scatter), and 1 / world turns that sum into the mean FSDP2 takes for every other parameter
        from .ep import apply_expert_parallel, expert_parallel_layers, world_mesh

        apply_expert_parallel(model, mesh, grad_scale=1.0 / mesh.size())
        ignored = {p for moe in expert_parallel_layers(model) for p in moe.experts.parameters()}
        # every rank is a data-parallel rank (its own batch rows): the rest is sharded over all of them, on the
        # one mesh the expert shards live on (clip_grad_norm_ and Muon take DTensors of a single mesh)
        mesh = world_mesh(mesh)
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=mp, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=ignored)
    # the fused head + cross-entropy of training takes lm_head.weight from plain_head_weight() before the forward:
    # run as a root forward, the call unshards the root's parameters first (else it returns this rank's shard)
    register_fsdp_forward_method(model, "plain_head_weight")
    return model


def check_data_parallel(tcfg: TrainConfig, dcfg: DataConfig, recipe_hooks: bool) -> None:
    """ConfigError for what data-parallel training does not run yet, naming the setting to change."""
    todo = []
    if tcfg.compile:
        todo.append("train.compile=true (torch.compile of each unit before fully_shard): set train.compile=false")
    if dcfg.passkey_fraction > 0:
        todo.append("data.passkey_fraction > 0 (the passkey mix per rank): set data.passkey_fraction=0")
    if recipe_hooks:
        todo.append("a recipe's model hooks (k3 quantize --mode qat): run it on one process")
    if todo:
        raise ConfigError("not built yet for parallel.dp > 1: " + "; ".join(todo))
