"""Multi-token prediction module, depth 1 (architecture.md section 10; DeepSeek-V3 arXiv 2412.19437 section 2.2).

    h'_i = M [ RMSNorm(h_i) ; RMSNorm(Emb(t_{i+1})) ]         M = eh_proj [D, 2D]
    h    = TRM(h')                                             one gated NoPE MLA layer + dense C2-GLU MLP, Pre-LN
    P(t_{i+2}) = softmax(Head(norm(h)))                        embedding and head shared with the main model

h_i is the main model's final hidden state (before the final norm). The module reads the main model's hidden
states and never writes into the main path, so main logits are unchanged by its presence (tested). Its MLA is NoPE
so that a speculative draft rolls back by truncating its latent cache (architecture.md section 10, k3 choice).

Legend: B batch, T tokens, D width.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .cache import MLACache, PagedLatentView
from .config import ModelConfig
from .layers import GatedMLP, RMSNorm
from .mla import GatedMLA


class MTPModule(nn.Module):
    """One MTP depth. Names follow DeepSeek-V3's MTP layer: hnorm, enorm, eh_proj, then a Pre-LN block and `norm`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, eps = cfg.d_model, cfg.rms_norm_eps
        self.hnorm = RMSNorm(d, eps)
        self.enorm = RMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = GatedMLA(dataclasses.replace(cfg, mla_position="nope"), layer_idx=cfg.n_layers)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = GatedMLP(d, cfg.dense_intermediate_size, cfg.hidden_act, cfg.c2glu_beta1, cfg.c2glu_beta2)
        self.norm = RMSNorm(d, eps)

    def forward(self, h_BTD: torch.Tensor, next_emb_BTD: torch.Tensor,
                cache: MLACache | PagedLatentView | None = None) -> torch.Tensor:
        """h_BTD: main hidden at positions i; next_emb_BTD: Emb(t_{i+1}); cache: the block's latent view
        (k3.model.cache). Returns the block's output [B, T, D] before `norm`: `norm` then the shared LM head
        predict t_{i+2} (K3Model.mtp_logits), and a recursive draft feeds the output itself back as the next h."""
        x = self.eh_proj(torch.cat([self.hnorm(h_BTD), self.enorm(next_emb_BTD)], dim=-1))
        x = x + self.self_attn(self.input_layernorm(x), cache=cache)
        return x + self.mlp(self.post_attention_layernorm(x))
