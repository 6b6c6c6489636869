"""Expert parallelism for Stable LatentMoE: each rank holds E / ep routed experts and the latent rows travel to them.

`apply_expert_parallel(model, mesh)` replaces every LatentMoE's `experts` (a GroupedExperts of all E experts) by an
`ExpertParallelExperts` holding rank r's contiguous block of expert ids [r G, (r + 1) G), G = E / ep, as DTensors
sharded along dim 0 over the EP mesh (so the global gradient norm, Muon's local NS5 on whole expert matrices, DCP
checkpoints and the gathered release treat them like FSDP2's shards). The model is unaware of ranks: LatentMoE still
calls `self.experts(z_ML, counts_E)` with its rows grouped by global expert id, and gets its rows back in that order.

One forward, on rank r of P (docs/parallel.md, "Expert parallelism"):
1. rows for rank s are the caller's rows of experts [s G, (s + 1) G): already contiguous (grouped by global id);
2. counts exchange: all_to_all_single of counts_E [E] int64 (G per peer) -> recv [P G]: rows from source s for
   local expert j at s G + j; the one host read of the layer follows (the split sizes all_to_all_single needs);
3. rows: an autograd all_to_all_single (its backward is the reverse all_to_all of the gradients);
4. the received rows (grouped by source, then expert) regrouped by local expert with moe_permute (K = 1), the
   GroupedExperts math on the local weights, the inverse regrouping (moe_unpermute with unit weights: exact);
5. the reverse all_to_all_single returns every row to its caller, in the caller's order. Dropless: every row runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from k3.kernels.moe import moe_grouped_mm, moe_permute, moe_unpermute
from k3.model.config import ConfigError
from k3.model.moe import GroupedExperts, LatentMoE

_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows [M, W]: in_splits[s] rows to rank s, out_splits[s] rows from rank s. The backward
    sends the gradients back along the same routes (the reverse all_to_all: splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        gx = g.new_empty((sum(ctx.in_splits), *g.shape[1:]))
        dist.all_to_all_single(gx, g.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return gx, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale` (the 1 / world of FSDP2's gradient averaging)."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def _mesh_1d(mesh):
    if getattr(mesh, "ndim", None) != 1:
        raise ValueError(f"expert parallelism takes a 1-D DeviceMesh of the EP ranks, got {mesh!r}")
    return mesh


class ExpertParallelExperts(GroupedExperts):
    """This rank's G = E / ep experts of a LatentMoE, called like GroupedExperts with all E experts' rows.

    `gate_up_proj` [E, 2F, L] and `down_proj` [E, L, F] are DTensors sharded along dim 0 over `mesh` (global
    shapes; this rank's local block [G, ...] holds experts rank * G .. rank * G + G - 1). `grad_scale` multiplies the
    expert gradients (1 / world under FSDP2's averaged gradients: an expert's gradient already sums every rank's
    tokens through the reverse all_to_all). `last_splits` keeps (rows sent to each rank, rows received from each
    rank) of the latest forward, for logging and the tests.
    Example: moe.experts = ExpertParallelExperts.from_full(moe.experts, mesh)
    """

    def __init__(self, num_experts: int, d_latent: int, d_ff: int, act: str, beta1: float, beta2: float, mesh,
                 grad_scale: float = 1.0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        mesh = _mesh_1d(mesh)
        ep = mesh.size()
        if num_experts % ep:
            raise ConfigError(f"expert parallelism over {ep} ranks needs model.num_experts ({num_experts}) divisible "
                              f"by parallel.ep={ep}; pick an ep that divides it")
        self.ep, self.rank, self.num_local = ep, mesh.get_local_rank(), num_experts // ep
        super().__init__(self.num_local, d_latent, d_ff, act, beta1, beta2)
        self.num_experts, self.mesh, self.group, self.grad_scale = num_experts, mesh, mesh.get_group(), grad_scale
        self.last_splits: tuple[list[int], list[int]] | None = None
        from torch.distributed.tensor import DTensor, Shard

        for name in _EXPERT_PARAMS:  # the local blocks as shards of the global [E, ...] stacks
            local = getattr(self, name).data.to(device=device, dtype=dtype)
            setattr(self, name, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False)))

    @classmethod
    def from_full(cls, full: GroupedExperts, mesh, grad_scale: float = 1.0) -> ExpertParallelExperts:
        """The sharded twin of `full` (all E experts, identical on every rank): this rank's block copied out."""
        if type(full) is not GroupedExperts or full.fake_quant is not None or full.input_observer is not None:
            raise ConfigError("expert parallelism shards plain GroupedExperts; quantized or quantization-aware "
                              "experts (k3 quantize) run on one process")
        w = full.gate_up_proj
        new = cls(w.shape[0], w.shape[2], full.d_ff, full.act, full.beta1, full.beta2, mesh, grad_scale, w.device,
                  w.dtype)
        lo = new.rank * new.num_local
        with torch.no_grad():
            for name in _EXPERT_PARAMS:
                w_full, w = getattr(full, name), getattr(new, name)
                w.to_local().copy_(w_full[lo:lo + new.num_local])
        return new

    def expert_mm(self, x_MI: torch.Tensor, name: str, counts_E: torch.Tensor) -> torch.Tensor:
        # GroupedExperts.expert_mm on this rank's block: the local tensor of the DTensor parameter (its gradient
        # returns as a Shard(0) DTensor), scaled in the backward by grad_scale
        if self.fake_quant is not None or self.input_observer is not None:
            raise ConfigError("expert-parallel experts do not run GroupedExperts' quantization hooks (fake_quant, "
                              "input_observer); quantization-aware training and calibration run on one process")
        w = getattr(self, name).to_local()
        if self.grad_scale != 1.0:
            w = _ScaleGrad.apply(w, self.grad_scale)
        return moe_grouped_mm(x_MI, w, counts_E)

    def forward(self, x_ML: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """x_ML [M, L] rows grouped by global expert id (counts_E [E]) -> y_ML [M, L] in the same order."""
        P, G = self.ep, self.num_local
        if counts_E.numel() != self.num_experts:
            raise ValueError(f"expected counts for {self.num_experts} experts, got {counts_E.numel()}")
        counts_E = counts_E.to(torch.int64)
        recv_SG = torch.empty(P * G, dtype=torch.int64, device=counts_E.device)
        dist.all_to_all_single(recv_SG, counts_E.contiguous(), group=self.group)  # G counts to each peer
        # the host read: all_to_all_single takes its split sizes as Python ints (one .tolist() per layer forward)
        sizes = torch.cat([counts_E.view(P, G).sum(1), recv_SG.view(P, G).sum(1), recv_SG]).tolist()
        in_splits, out_splits = sizes[:P], sizes[P:2 * P]
        self.last_splits = (in_splits, out_splits)
        R = sum(out_splits)
        x_RL = _AllToAll.apply(x_ML, out_splits, in_splits, self.group)
        # received rows come grouped by source rank, then local expert: regroup by local expert (stable, so each
        # expert's rows keep source order), run the experts, undo the regrouping
        if R == 0:  # no row for this rank's experts: run them on none, so their gradients are zeros, not None
            y_RL = super().forward(x_RL, recv_SG.view(P, G).sum(0))
        else:
            eid_R = torch.repeat_interleave(torch.arange(G, device=x_ML.device).repeat(P), recv_SG, output_size=R)
            x_loc, order_R, local_counts_G = moe_permute(x_RL, eid_R.view(R, 1), G)
            y_loc = super().forward(x_loc, local_counts_G)
            y_RL = moe_unpermute(y_loc, order_R, torch.ones(R, 1, dtype=y_loc.dtype, device=y_loc.device))
        return _AllToAll.apply(y_RL, in_splits, out_splits, self.group)


def expert_parallel_layers(model: nn.Module) -> list[LatentMoE]:
    return [m for m in model.modules() if isinstance(m, LatentMoE)]


def apply_expert_parallel(model: nn.Module, mesh, grad_scale: float = 1.0) -> nn.Module:
    """Swap every LatentMoE's experts for this rank's ExpertParallelExperts (in place; every rank calls it with the
    same full weights). mesh: a 1-D DeviceMesh of the EP ranks. Returns model.
    Example: apply_expert_parallel(model, init_device_mesh("cpu", (2,)))"""
    layers = expert_parallel_layers(model)
    if not layers:
        raise ConfigError("parallel.ep > 1 but the model has no LatentMoE layer (model.mlp_types has no 'moe')")
    for moe in layers:
        if not isinstance(moe.experts, ExpertParallelExperts):
            moe.experts = ExpertParallelExperts.from_full(moe.experts, mesh, grad_scale)
    return model


@torch.no_grad()
def remove_expert_parallel(model: nn.Module) -> nn.Module:
    """The inverse of apply_expert_parallel: every LatentMoE gets a GroupedExperts with all E experts' weights
    gathered from the EP ranks (collective: every rank calls it). Returns model."""
    for moe in expert_parallel_layers(model):
        ep = moe.experts
        if not isinstance(ep, ExpertParallelExperts):
            continue
        full = GroupedExperts(ep.num_experts, ep.gate_up_proj.shape[2], ep.d_ff, ep.act, ep.beta1, ep.beta2)
        for name in _EXPERT_PARAMS:
            w = getattr(ep, name)
            getattr(full, name).data = w.full_tensor().detach().clone()
        moe.experts = full
    return model

