"""The train loop on several data-parallel ranks: k3.train.loop.Trainer with its statistics reduced over the ranks.

Nothing of the step changes but what crosses ranks: losses are averaged and tokens summed (the logged figures are
the global batch's), the MLA max logits are maxed before QK-Clip (every rank clips the same heads of its rows),
the router scores of every rank are gathered before the bias update (Quantile Balancing sees the global batch, as
one process would), a stop signal on any rank stops every rank at the same step, evaluation sums are reduced, and
only rank 0 writes metrics.jsonl. Checkpoints go through DistributedCheckpointer (DCP). Under expert parallelism
each step also logs `ep_load_max_mean`: the rows the busiest rank's experts received over the mean over all ranks
(under dp x ep each EP group serves its own tokens), worst layer.
"""

from __future__ import annotations

import torch

from ..loop import Trainer
from .checkpoint import DistributedCheckpointer
from .ep import ExpertParallelExperts
from .runtime import Distributed


class DistributedTrainer(Trainer):
    """Trainer(..., dist=d): the same loop on rank d.rank of d.world_size (module docstring)."""

    def __init__(self, *args, dist: Distributed, **kwargs):
        super().__init__(*args, **kwargs)
        self.dist = dist
        self.ckpt = DistributedCheckpointer(self.ccfg, self.run_dir, dist, self.model, self.opt)

    def _over_ranks(self, x: torch.Tensor, op: str) -> torch.Tensor:
        return self.dist.all_reduce(x, op)

    def _log(self, rec: dict) -> None:
        if self.dist.is_main:
            super()._log(rec)

    def _balance_routers(self, scores_per_layer: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> dict:
        # every rank's scores [N, E] and routes [N, K], rank 0's first: the exact quantiles and the loads of the
        # global batch, so the replicated router bias stays identical on every rank
        gathered = {}
        for i in sorted(scores_per_layer):
            chunks = scores_per_layer[i]
            scores, topk = torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])
            gathered[i] = [(self.dist.all_gather_rows(scores), self.dist.all_gather_rows(topk))]
        return {**super()._balance_routers(gathered), **self._ep_load(gathered)}

    def _ep_load(self, gathered: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> dict:
        # under expert parallelism: the rows each rank's experts received this step, as max / mean over all ranks,
        # for the worst MoE layer; static placement. From the globally gathered routes (rank-major, so the routes of
        # EP group g, ranks g P .. g P + P - 1, are its P consecutive blocks): what the all_to_alls carried
        moes, worst = self.model.moe_layers(), None
        for i, chunks in gathered.items():
            experts = moes[i].experts
            if not isinstance(experts, ExpertParallelExperts):
                continue
            topk = chunks[0][1]
            groups = self.dist.world_size // experts.ep
            host_GR = experts.host_of(topk.reshape(groups, -1))  # [groups, rows]: the EP coordinate of each row
            rows = torch.zeros(groups, experts.ep, dtype=torch.long, device=topk.device).scatter_add_(
                1, host_GR, torch.ones_like(host_GR)).double()
            ratio = float(rows.max() / rows.mean().clamp_min(1e-12))
            worst = ratio if worst is None else max(worst, ratio)
        return {} if worst is None else {"ep_load_max_mean": worst}
