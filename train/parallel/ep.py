"""Expert parallelism for Stable LatentMoE: the latent rows travel to the rank that computes their expert.

`apply_expert_parallel(model, mesh)` replaces every LatentMoE's `experts` (a GroupedExperts of all E experts) by an
`ExpertParallelExperts`. Two layouts (docs/parallel.md, "Expert parallelism"):
- a 1-D mesh of all P ranks (parallel.ep = world size): rank r computes and stores experts [r G, (r + 1) G), G = E / P;
- a 2-D mesh ("dp", "ep") of D x P ranks, rank q = d P + s (s its EP coordinate): each of the D EP groups (ranks
  d P .. d P + P - 1) dispatches its own tokens among itself, and EP rank s computes G = E / P experts. They are
  stored sharded over all W = D P ranks: rank q holds the c = E / W experts [q c, (q + 1) c), so EP rank s computes
  the chunks s, P + s, .., (D - 1) P + s (global expert (k P + s) c + m is its local expert k c + m) and gathers them
  over its dp group (ranks s, P + s, ..) before each use; the backward reduce-scatters their gradients back.
Either way the expert weights are DTensors sharded along dim 0 over the 1-D mesh of all ranks in rank order (the
mesh FSDP2 shards everything else over), so the global gradient norm, Muon's local NS5 on whole expert matrices, DCP
checkpoints and the gathered release treat them like FSDP2's shards. The model is unaware of ranks: LatentMoE still
calls `self.experts(z_ML, counts_E)` with its rows grouped by global expert id, and gets its rows back in that order.

One forward, on EP rank s of P (D = 1 skips steps 1 and 4's gather):
1. D > 1: the caller's rows (grouped by global id, i.e. by chunk k, host s, expert m) reordered by host rank, then
   k, then m, so that each host's rows are contiguous and in its local expert order;
2. counts exchange: all_to_all_single of the [E] counts in that order (G per peer) -> recv [P G]: rows from source
   s' for local expert j at s' G + j; the one host read of the layer follows (the split sizes all_to_all_single needs);
3. rows: an autograd all_to_all_single over the EP group (its backward is the reverse all_to_all of the gradients);
4. the received rows (grouped by source rank, then expert) regrouped by local expert with moe_permute (K = 1), the
   GroupedExperts math on the local weights (D > 1: all-gathered over the dp group), the inverse regrouping
   (moe_unpermute with unit weights: exact);
5. the reverse all_to_all_single returns every row to its caller, in the caller's order (D > 1: step 1 undone).
Dropless: every row runs.
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


class _GatherRows(torch.autograd.Function):
    """all_gather of equal [c, ...] blocks over `group` -> [n c, ...] in group-rank order; the backward sums the
    gradient over the group and returns each rank its block (reduce-scatter), as FSDP2 does for its shards."""

    @staticmethod
    def forward(ctx, w, group, n: int):
        ctx.group, ctx.rows = group, w.shape[0]
        out = w.new_empty((n * w.shape[0], *w.shape[1:]))
        dist.all_gather_into_tensor(out, w.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        gw = g.new_empty((ctx.rows, *g.shape[1:]))
        dist.reduce_scatter_tensor(gw, g.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return gw, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale` (the 1 / world of FSDP2's gradient averaging)."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def world_mesh(mesh):
    """The 1-D mesh of all ranks in rank order that FSDP2 and the expert shards share: `mesh` itself when 1-D, the
    2-D ("dp", "ep") mesh flattened (row-major: rank d P + s) otherwise; the same object on every call."""
    return mesh if mesh.ndim == 1 else mesh._flatten("dp_ep")


def _meshes(mesh):
    """(EP mesh, dp mesh or None) of a 1-D mesh of the EP ranks or a 2-D ("dp", "ep") mesh."""
    ndim, names = getattr(mesh, "ndim", None), getattr(mesh, "mesh_dim_names", None)
    if ndim == 1:
        return mesh, None
    if ndim == 2 and tuple(names or ()) == ("dp", "ep"):
        return mesh["ep"], (mesh["dp"] if mesh["dp"].size() > 1 else None)
    raise ValueError(f"expert parallelism takes a 1-D DeviceMesh of the EP ranks or a 2-D one named ('dp', 'ep'), "
                     f"got {mesh!r}")


class ExpertParallelExperts(GroupedExperts):
    """This rank's experts of a LatentMoE (module docstring), called like GroupedExperts with all E experts' rows.

    `gate_up_proj` [E, 2F, L] and `down_proj` [E, L, F] are DTensors sharded along dim 0 over `world_mesh(mesh)`
    (global shapes; this rank's local block [c, ...], c = E / world, holds experts q c .. q c + c - 1 of rank q).
    `num_local` (G = E / ep) experts run here: the local block itself (1-D mesh) or the dp group's blocks gathered.
    `grad_scale` multiplies the expert gradients (1 / world under FSDP2's averaged gradients: an expert's gradient
    already sums every rank's tokens, through the reverse all_to_all and the dp reduce-scatter). `last_splits`
    keeps (rows sent to each EP rank, rows received from each EP rank) of the latest forward, for logging and tests.
    Example: moe.experts = ExpertParallelExperts.from_full(moe.experts, mesh)
    """

    def __init__(self, num_experts: int, d_latent: int, d_ff: int, act: str, beta1: float, beta2: float, mesh,
                 grad_scale: float = 1.0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        ep_mesh, dp_mesh = _meshes(mesh)
        ep, dp = ep_mesh.size(), 1 if dp_mesh is None else dp_mesh.size()
        if num_experts % ep:
            raise ConfigError(f"expert parallelism over {ep} ranks needs model.num_experts ({num_experts}) divisible "
                              f"by parallel.ep={ep}; pick an ep that divides it")
        if num_experts % (dp * ep):
            raise ConfigError(f"parallel.dp={dp} x parallel.ep={ep} stores the experts sharded over all {dp * ep} "
                              f"ranks and needs model.num_experts ({num_experts}) divisible by {dp * ep}; pick dp "
                              f"and ep whose product divides it")
        self.ep, self.dp, self.num_local = ep, dp, num_experts // ep
        self.rank = ep_mesh.get_local_rank()  # EP coordinate s
        self.dp_rank = 0 if dp_mesh is None else dp_mesh.get_local_rank()
        self.num_stored = num_experts // (dp * ep)
        super().__init__(self.num_local, d_latent, d_ff, act, beta1, beta2)
        self.num_experts, self.mesh, self.grad_scale = num_experts, world_mesh(mesh), grad_scale
        self.group = ep_mesh.get_group()
        self.dp_group = None if dp_mesh is None else dp_mesh.get_group()
        self.last_splits: tuple[list[int], list[int]] | None = None
        from torch.distributed.tensor import DTensor, Shard

        for name in _EXPERT_PARAMS:  # the stored blocks (own storage of c experts) as shards of the [E, ...] stacks
            local = getattr(self, name).data[:self.num_stored].to(device=device, dtype=dtype, copy=True)
            setattr(self, name, nn.Parameter(DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False)))

    @property
    def stored_range(self) -> tuple[int, int]:
        """[lo, hi) of the global expert ids whose weights this rank stores (its DTensor shard)."""
        q = self.dp_rank * self.ep + self.rank
        return q * self.num_stored, (q + 1) * self.num_stored

    def host_of(self, expert_E: torch.Tensor) -> torch.Tensor:
        """The EP coordinate that computes each global expert id: (e // c) % ep."""
        return (expert_E // self.num_stored) % self.ep

    @classmethod
    def from_full(cls, full: GroupedExperts, mesh, grad_scale: float = 1.0) -> ExpertParallelExperts:
        """The sharded twin of `full` (all E experts, identical on every rank): this rank's block copied out."""
        if type(full) is not GroupedExperts or full.fake_quant is not None or full.input_observer is not None:
            raise ConfigError("expert parallelism shards plain GroupedExperts; quantized or quantization-aware "
                              "experts (k3 quantize) run on one process")
        w = full.gate_up_proj
        new = cls(w.shape[0], w.shape[2], full.d_ff, full.act, full.beta1, full.beta2, mesh, grad_scale, w.device,
                  w.dtype)
        lo, hi = new.stored_range
        with torch.no_grad():
            for name in _EXPERT_PARAMS:
                getattr(new, name).to_local().copy_(getattr(full, name)[lo:hi])
        return new

    def expert_mm(self, x_MI: torch.Tensor, name: str, counts_E: torch.Tensor) -> torch.Tensor:
        # GroupedExperts.expert_mm on the G experts run here: the local tensor of the DTensor parameter (its gradient
        # returns as a Shard(0) DTensor), gathered over the dp group when D > 1, scaled in the backward by grad_scale
        if self.fake_quant is not None or self.input_observer is not None:
            raise ConfigError("expert-parallel experts do not run GroupedExperts' quantization hooks (fake_quant, "
                              "input_observer); quantization-aware training and calibration run on one process")
        w = getattr(self, name).to_local()
        if self.grad_scale != 1.0:
            w = _ScaleGrad.apply(w, self.grad_scale)
        if self.dp_group is not None:  # [c, ...] -> [G = D c, ...]: chunk k of the dp group is local experts k c ..
            w = _GatherRows.apply(w, self.dp_group, self.dp)
        return moe_grouped_mm(x_MI, w, counts_E)

    def _by_host(self, counts_E: torch.Tensor, M: int) -> tuple[torch.Tensor, torch.Tensor]:
        """D > 1: (counts in host order (s, k, m) [E], idx_M: the caller's row at each position of that order)."""
        D, P, c = self.dp, self.ep, self.num_stored
        start_E = torch.cumsum(counts_E, 0) - counts_E  # first row of each expert in the caller's order
        counts_H = counts_E.view(D, P, c).transpose(0, 1).reshape(-1)
        start_H = start_E.view(D, P, c).transpose(0, 1).reshape(-1)
        shift_H = start_H - (torch.cumsum(counts_H, 0) - counts_H)
        idx_M = torch.arange(M, device=counts_E.device) + torch.repeat_interleave(shift_H, counts_H, output_size=M)
        return counts_H, idx_M

    def forward(self, x_ML: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """x_ML [M, L] rows grouped by global expert id (counts_E [E]) -> y_ML [M, L] in the same order."""
        P, G = self.ep, self.num_local
        if counts_E.numel() != self.num_experts:
            raise ValueError(f"expected counts for {self.num_experts} experts, got {counts_E.numel()}")
        counts_E = counts_E.to(torch.int64)
        idx_M = None
        if self.dp_group is not None:  # step 1: each host's rows contiguous, in its local expert order
            counts_E, idx_M = self._by_host(counts_E, x_ML.shape[0])
            x_ML = x_ML.index_select(0, idx_M)
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
        y_ML = _AllToAll.apply(y_RL, in_splits, out_splits, self.group)
        if idx_M is not None:  # step 1 undone: the caller's order
            inv_M = torch.empty_like(idx_M)
            inv_M[idx_M] = torch.arange(idx_M.numel(), device=idx_M.device)
            y_ML = y_ML.index_select(0, inv_M)
        return y_ML


def expert_parallel_layers(model: nn.Module) -> list[LatentMoE]:
    return [m for m in model.modules() if isinstance(m, LatentMoE)]


def apply_expert_parallel(model: nn.Module, mesh, grad_scale: float = 1.0) -> nn.Module:
    """Swap every LatentMoE's experts for this rank's ExpertParallelExperts (in place; every rank calls it with the
    same full weights). mesh: a 1-D DeviceMesh of the EP ranks, or a 2-D one named ("dp", "ep"). Returns model.
    Example: apply_expert_parallel(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep")))"""
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

