"""Stable LatentMoE with a sigmoid router (architecture.md sections 7 and 9.1).

    y = Shared(x) + W_up . RMSNorm_l( sum_{j in TopK(x)} p_j * Expert_j(W_down x) )

- Routing on the full-width x: s = sigmoid(x W_r^T) in fp32; selection on s + b (b = QB bias buffer, no gradient);
  weights p from the UNBIASED s of the selected experts, renormalized over them, times `routed_scaling_factor`
  (DeepSeek-V3 section 2.1.2, arXiv 2412.19437).
- Experts are C2-GLU MLPs in the latent width l; the RMSNorm acts on the weighted aggregate, never per expert
  (K3 "Normalized LatentMoE inserts RMSNorm before the up-projection"; reported). `latent_norm_pos` = "post_down"
  (norm between W_down and the experts) and "none" (NVIDIA LatentMoE, arXiv 2601.18089) are ablations.
- Shared experts (K3: two, full width d) see x itself, unrouted and unscaled; the two are fused into one gated MLP of
  width num_shared * m, which equals their sum (concatenating hidden units adds the outputs).
- Expert compute is grouped: tokens sorted by expert, each expert on one contiguous slice (k3.kernels.moe).

Legend: B batch, T tokens, N = B*T, D model width, E experts, K experts per token, M = N*K routed rows,
L latent width l, F expert width m.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3.kernels.moe import moe_grouped_mm, moe_permute, moe_unpermute

from .config import ConfigError, ModelConfig
from .layers import GatedMLP, RMSNorm, glu_activation_packed


class Router(nn.Module):
    """Sigmoid top-K router with a selection-only fp32 bias (the Quantile Balancing / Loss-Free target).

    `weight` [E, D] is a trained parameter; `e_score_correction_bias` [E] is a persistent fp32 buffer (it reaches
    checkpoints and inference needs it) that the trainer replaces after each optimizer step; it gets no gradient.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, routed_scaling_factor: float = 1.0):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ConfigError(f"router top_k ({top_k}) must lie in [1, num_experts = {num_experts}]")
        self.num_experts, self.top_k, self.routed_scaling_factor = num_experts, top_k, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[1])  # nn.Linear's default range
        nn.init.uniform_(self.weight, -bound, bound)

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` casts every float buffer; the bias must stay fp32 (spec 9.1), so restore it
        # from the pre-cast values on the new device.
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        new = self.e_score_correction_bias
        if new.dtype != torch.float32 and not new.is_meta:
            self.e_score_correction_bias = bias.to(device=new.device, dtype=torch.float32)
        return self

    def forward(self, x_ND: torch.Tensor):
        """Route N tokens.

        Args: x_ND [N, D] (any float dtype).
        Returns: scores_NE [N, E] unbiased sigmoid scores, fp32 (float64 for float64 x), differentiable;
        topk_idx_NK [N, K] int64 in biased-score order (ties -> lowest expert index); topk_weight_NK [N, K] in the
        scores' dtype, differentiable.

        Example: s, idx, w = router(x.view(-1, d)); w.sum(-1) == routed_scaling_factor
        """
        dt = torch.promote_types(x_ND.dtype, torch.float32)  # fp32 (float64 stays float64 for reference tests)
        with torch.autocast(device_type=x_ND.device.type, enabled=False):  # router math stays fp32 under autocast
            logits_NE = F.linear(x_ND.to(dt), self.weight.to(dt))
        scores_NE = torch.sigmoid(logits_NE)
        biased_NE = scores_NE.detach() + self.e_score_correction_bias.to(dt)
        # a stable descending sort keeps equal values in index order: exact lowest-index tie-break (topk does not
        # promise one). E is small enough (K3: 896) that a full sort per token is cheap next to the experts.
        topk_idx_NK = torch.sort(biased_NE, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        sel_NK = scores_NE.gather(1, topk_idx_NK)
        topk_weight_NK = sel_NK / sel_NK.sum(-1, keepdim=True) * self.routed_scaling_factor
        return scores_NE, topk_idx_NK, topk_weight_NK


class GroupedExperts(nn.Module):
    """E gated MLPs in the latent width, stored as 3-D params (nn.Linear layout per expert).

    `gate_up_proj` [E, 2F, L] packs [gate | up] along dim 1; `down_proj` [E, L, F].
    Quantization hooks (k3.model.quant): `fake_quant` (a k3.kernels.quant.FakeQuant, or None) makes both grouped
    matmuls quantization-aware (fake-quantized weights and activations, straight-through gradients; learned int4
    scales are the parameters `gate_up_proj_scales` [E, 2F, L/g] and `down_proj_scales` [E, L, F/g]);
    `input_observer` (callable(name, x_MI, counts_E), or None) sees each matmul's input (calibration).
    k3.model.quant.QuantGroupedExperts overrides `expert_mm` to run on stored quantized weights.
    """

    def __init__(self, num_experts: int, d_latent: int, d_ff: int, act: str = "c2glu", beta1: float = 4.0,
                 beta2: float = 25.0):
        super().__init__()
        self.d_ff, self.act, self.beta1, self.beta2 = d_ff, act, beta1, beta2
        self.fake_quant = None
        self.input_observer = None
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * d_ff, d_latent))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_latent, d_ff))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # per expert, nn.Linear's default range U(-1/sqrt(fan_in), 1/sqrt(fan_in)); k3.model.init may override
        for w in (self.gate_up_proj, self.down_proj):
            bound = 1.0 / math.sqrt(w.shape[2])
            nn.init.uniform_(w, -bound, bound)

    def expert_mm(self, x_MI: torch.Tensor, name: str, counts_E: torch.Tensor) -> torch.Tensor:
        """One grouped matmul: x_MI [M, I] through weight `name` ("gate_up_proj" | "down_proj") -> [M, O]."""
        if self.input_observer is not None:
            self.input_observer(name, x_MI, counts_E)
        w_EOI, fq = getattr(self, name), self.fake_quant
        if fq is not None:  # learned scales: the parameter `<name>_scales` that enable_fake_quant registered
            x_MI, w_EOI = fq.act(x_MI), fq.weight(w_EOI, getattr(self, name + "_scales", None))
        return moe_grouped_mm(x_MI, w_EOI, counts_E)

    def forward(self, x_ML: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """x_ML [M, L] rows grouped by expert (counts_E [E] rows each) -> y_ML [M, L], each row through its expert."""
        gu_M2F = self.expert_mm(x_ML, "gate_up_proj", counts_E)
        h_MF = glu_activation_packed(gu_M2F, self.act, self.beta1, self.beta2)
        return self.expert_mm(h_MF, "down_proj", counts_E)


class LatentMoE(nn.Module):
    """Stable LatentMoE block: x [B, T, D] -> y [B, T, D] (the MLP half of a K3 layer, architecture.md 7.1).

    Set `record_router = True` to keep detached `last_scores` [N, E] fp32 and `last_topk_idx` [N, K] from each
    forward, for the trainer's balance update (k3.train.balance).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.latent_norm_pos not in ("pre_up", "post_down", "none"):
            raise ConfigError(f"model.latent_norm_pos must be pre_up, post_down or none, got {cfg.latent_norm_pos!r}")
        D, L, F_, E = cfg.d_model, cfg.moe_latent_size, cfg.moe_intermediate_size, cfg.num_experts
        self.d_model, self.num_experts, self.latent_norm_pos = D, E, cfg.latent_norm_pos
        self.gate = Router(D, E, cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        self.fc1_latent_proj = nn.Linear(D, L, bias=False)  # W_down [L, D]
        self.fc2_latent_proj = nn.Linear(L, D, bias=False)  # W_up [D, L]
        self.experts = GroupedExperts(E, L, F_, cfg.hidden_act, cfg.c2glu_beta1, cfg.c2glu_beta2)
        self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps) if cfg.latent_norm_pos != "none" else None
        self.shared_experts = (GatedMLP(D, cfg.num_shared_experts * F_, cfg.hidden_act, cfg.c2glu_beta1,
                                        cfg.c2glu_beta2) if cfg.num_shared_experts > 0 else None)
        self.record_router: bool = False
        self.last_scores: torch.Tensor | None = None
        self.last_topk_idx: torch.Tensor | None = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """y = shared(x) + W_up Norm(sum_j p_j Expert_j(W_down x)). x_BTD [B, T, D] -> [B, T, D], x's dtype."""
        if x_BTD.dim() != 3 or x_BTD.shape[-1] != self.d_model:
            raise ValueError(f"LatentMoE expects x [B, T, {self.d_model}], got {tuple(x_BTD.shape)}")
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)

        scores_NE, topk_idx_NK, topk_weight_NK = self.gate(x_ND)  # (1) route on full-width x
        if self.record_router:
            self.last_scores, self.last_topk_idx = scores_NE.detach(), topk_idx_NK.detach()

        z_NL = self.fc1_latent_proj(x_ND)  # (2) down-project to the latent width
        if self.latent_norm_pos == "post_down":
            z_NL = self.routed_expert_norm(z_NL)
        z_ML, order_M, counts_E = moe_permute(z_NL, topk_idx_NK, self.num_experts)
        y_ML = self.experts(z_ML, counts_E)  # (3) top-K experts in latent space ...
        agg_NL = moe_unpermute(y_ML, order_M, topk_weight_NK)  # ... weighted sum per token
        if self.latent_norm_pos == "pre_up":
            agg_NL = self.routed_expert_norm(agg_NL)  # (4) RMSNorm on the aggregate
        y_ND = self.fc2_latent_proj(agg_NL)  # (5) up-project
        if self.shared_experts is not None:
            y_ND = y_ND + self.shared_experts(x_ND)  # (6) shared experts on the original x
        return y_ND.view(B, T, D)
