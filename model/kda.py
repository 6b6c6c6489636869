"""Kimi Delta Attention layer (kda.md section 4, architecture.md section 5).

Legend: B batch, T tokens, D model width, H heads, K key dim = V value dim, W conv kernel, C channels (H*K).

    q, k, v = SiLU(ShortConv_W(W_q x)), SiLU(ShortConv_W(W_k x)), SiLU(ShortConv_W(W_v x))
    q, k <- L2Norm(q), L2Norm(k) (eps 1e-6), q <- q K^-1/2                       (in kernel)
    z = W_fb(W_fa x) (rank K);  g = lb * sigmoid(exp(A_log) (z + dt_bias))       (in kernel; softplus gate if lb None)
    beta = sigmoid(W_b x)                                                        (in kernel)
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T;   o_t = S_t^T q_t
    y = W_o [ RMSNorm_head(o) * w * sigmoid(W_g x) ]                             (K3: full-rank W_g)

Sources: Kimi Linear (arXiv 2510.26692), MoonshotAI/Kimi-Linear; module names follow the Kimi-Linear checkpoint
layout (vLLM `kda.py`), except `g_proj` is full rank (K3) and A_log is stored as [H].
No positional encoding: the decay does that work. Inference state per layer: `k3.model.cache.KDACache`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3.kernels.conv import causal_conv1d
from k3.kernels.kda import chunk_kda, fused_recurrent_kda, naive_kda_gate, naive_kda_lowerbound_gate

from .cache import KDACache
from .config import ModelConfig

RECURRENT_MAX_TOKENS = 64  # eval-mode calls with a cache and at most this many new tokens use the recurrent kernel


class GatedRMSNorm(nn.Module):
    """Per-head output norm: RMSNorm(o) * weight * sigmoid(gate), in fp32 (float64 stays), returned in o's dtype.

    o, gate: [..., V]; weight: [V] (shared by all heads, the `o_norm` of fla's KDA layer).
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dt = torch.promote_types(o.dtype, torch.float32)  # fp32, or float64 for float64 models
        y = F.rms_norm(o.to(dt), (o.shape[-1],), self.weight.to(dt), self.eps)  # fused on CUDA (see RMSNorm)
        return (y * torch.sigmoid(gate.to(dt))).to(o.dtype)


def _depthwise_conv(channels: int, width: int) -> nn.Conv1d:
    """Storage for a causal depthwise conv: weight [C, 1, W]; applied by k3.kernels.conv.causal_conv1d."""
    return nn.Conv1d(channels, channels, width, groups=channels, bias=False)


class KimiDeltaAttention(nn.Module):
    """KDA token mixer. forward(x [B, T, D], cache=None, cu_seqlens=None) -> [B, T, D]."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        d, H, K, W = cfg.d_model, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_kernel
        self.layer_idx = layer_idx
        self.num_heads = H  # read by the optimizer (per-head Muon)
        self.head_k_dim = self.head_v_dim = K
        self.lower_bound = cfg.kda_gate_lower_bound
        self.chunk_size = cfg.kda_chunk_size
        self.q_proj = nn.Linear(d, H * K, bias=False)
        self.k_proj = nn.Linear(d, H * K, bias=False)
        self.v_proj = nn.Linear(d, H * K, bias=False)
        self.q_conv1d = _depthwise_conv(H * K, W)
        self.k_conv1d = _depthwise_conv(H * K, W)
        self.v_conv1d = _depthwise_conv(H * K, W)
        self.f_a_proj = nn.Linear(d, K, bias=False)  # low-rank decay gate
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(H * K, dtype=torch.float32))
        self.A_log._no_weight_decay = True  # fp32, AdamW without weight decay (kda.md section 2)
        self.dt_bias._no_weight_decay = True
        self.b_proj = nn.Linear(d, H, bias=False)
        self.g_proj = nn.Linear(d, H * K, bias=False)  # full-rank output gate (K3)
        self.o_norm = GatedRMSNorm(K, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(H * K, d, bias=False)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """fla's init: A_log = 0 with the lower-bound gate, else log U(1, 16); dt_bias = softplus^-1(dt),
        dt = exp(U(log 1e-3, log 1e-1)) clamped >= 1e-4 (kda.md section 2)."""
        H = self.num_heads
        if self.lower_bound is None:
            self.A_log.copy_(torch.empty(H, dtype=torch.float32).uniform_(1.0, 16.0).log())
        else:
            self.A_log.zero_()
        u = torch.rand(self.dt_bias.shape, dtype=torch.float32)
        dt = torch.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt) = dt + log(1 - exp(-dt))

    def compute_gate(self, z: torch.Tensor) -> torch.Tensor:
        """Log decay g [..., H, K] (fp32) from the raw gate projection z [..., H, K], with this layer's A_log/dt_bias."""
        if self.lower_bound is None:
            return naive_kda_gate(z, self.A_log, self.dt_bias)
        return naive_kda_lowerbound_gate(z, self.A_log, self.dt_bias, self.lower_bound)

    def gate_input(self, x: torch.Tensor) -> torch.Tensor:
        """Raw gate projection z = f_b(f_a(x)): [B, T, D] -> [B, T, H, K]."""
        return self.f_b_proj(self.f_a_proj(x)).unflatten(-1, (self.num_heads, self.head_k_dim))

    def forward(self, x: torch.Tensor, cache: KDACache | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D].

        cache: continue from `cache` (state [N, H, K, V] fp32, pre-conv tails [N, W-1, C]; None fields = empty) and
        update it in place; N = B, or the number of sequences with cu_seqlens ([N+1], B == 1, padding-free varlen).
        """
        T = x.shape[1]
        H, K = self.num_heads, self.head_k_dim
        with_cache = cache is not None
        tails = (cache.conv_q, cache.conv_k, cache.conv_v) if with_cache else (None, None, None)
        qkv, new_tails = [], []
        for proj, conv, tail in zip((self.q_proj, self.k_proj, self.v_proj),
                                    (self.q_conv1d, self.k_conv1d, self.v_conv1d), tails):
            y, t = causal_conv1d(proj(x), conv.weight[:, 0], activation="silu", initial_tail=tail,
                                 output_final_tail=with_cache, cu_seqlens=cu_seqlens)
            qkv.append(y.unflatten(-1, (H, K)))  # [B, T, H, K]
            new_tails.append(t)
        q, k, v = qkv
        kwargs = {"A_log": self.A_log, "dt_bias": self.dt_bias, "lower_bound": self.lower_bound,
                  "initial_state": cache.state if with_cache else None, "output_final_state": with_cache,
                  "use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
                  "cu_seqlens": cu_seqlens}
        if with_cache and not self.training and T <= RECURRENT_MAX_TOKENS:
            o, state = fused_recurrent_kda(q, k, v, self.gate_input(x), self.b_proj(x), **kwargs)
        else:
            o, state = chunk_kda(q, k, v, self.gate_input(x), self.b_proj(x), chunk_size=self.chunk_size,
                                 safe_gate=self.lower_bound is not None, **kwargs)
        if with_cache:
            cache.state = state
            cache.conv_q, cache.conv_k, cache.conv_v = new_tails
        o = self.o_norm(o, self.g_proj(x).unflatten(-1, (H, K)))  # [B, T, H, V]
        return self.o_proj(o.flatten(-2))
