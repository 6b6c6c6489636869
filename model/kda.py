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
No positional encoding: the decay does that work. Inference state per layer: a `k3.model.cache.KDAStateView`.
"""

from __future__ import annotations

import contextlib
import math
from functools import partial

import torch
from torch import nn

from k3.kernels.conv import causal_conv1d, causal_conv1d_multi
from k3.kernels.dispatch import trusted_inputs
from k3.kernels.kda import chunk_kda, fused_recurrent_kda, naive_kda_gate, naive_kda_lowerbound_gate
from k3.kernels.kda.fused_recurrent import fused_recurrent_kda_pool_trusted
from k3.kernels.norm import gated_rms_norm

from .cache import KDAStateView
from .config import ModelConfig

RECURRENT_MAX_TOKENS = 64  # eval-mode calls with a cache and at most this many new tokens per sequence: recurrent


class GatedRMSNorm(nn.Module):
    """Per-head output norm: RMSNorm(o) * weight * sigmoid(gate), in fp32 (float64 stays), returned in o's dtype
    (the op `k3.kernels.norm.gated_rms_norm`).

    o, gate: [..., V]; weight: [V] (shared by all heads, the `o_norm` of fla's KDA layer).
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(o, gate, self.weight, self.eps)  # one fused pass each way on the triton backend


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

    def kernel_kwargs(self) -> dict:
        """The kernels' in-kernel gate, beta sigmoid and q/k L2 norm settings of this layer (every call passes them)."""
        return {"A_log": self.A_log, "dt_bias": self.dt_bias, "lower_bound": self.lower_bound,
                "use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True}

    def forward(self, x: torch.Tensor, cache: KDAStateView | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D].

        cache: continue from and update a cache view (k3.model.cache: a contiguous KDACache, or the engine's pool
        view); N = B sequences, or with cu_seqlens ([N+1], B == 1, padding-free varlen; a view may carry its own)
        the packed ones.
        """
        if cache is None:
            return self._forward(x, None, cu_seqlens)
        if cache.cu_seqlens is not None:
            cu_seqlens = cache.cu_seqlens
        with trusted_inputs() if cache.trusted else contextlib.nullcontext():
            return self._forward(x, cache, cu_seqlens)

    def _forward(self, x: torch.Tensor, cache: KDAStateView | None, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        H, K = self.num_heads, self.head_k_dim
        with_cache = cache is not None
        pre = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]  # [B, T, C] pre-conv inputs
        weights = [conv.weight[:, 0] for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]  # [C, W]
        if with_cache:  # the tails carried in and out (inference)
            tails0 = cache.conv_tails()
            qkv, tails1 = [], []
            for p, w, tail in zip(pre, weights, tails0):
                y, t = causal_conv1d(p, w, activation="silu", initial_tail=tail, output_final_tail=True,
                                     cu_seqlens=cu_seqlens)
                qkv.append(y)
                tails1.append(t)
            cache.conv_done(tails0, tuple(tails1), pre)
        else:  # training: q, k and v in one launch on the triton backend
            qkv = causal_conv1d_multi(pre, weights, activation="silu", cu_seqlens=cu_seqlens)
        q, k, v = (y.unflatten(-1, (H, K)) for y in qkv)  # [B, T, H, K]
        o = self.recurrence(q, k, v, self.gate_input(x), self.b_proj(x), cache, cu_seqlens)
        o = self.o_norm(o, self.g_proj(x).unflatten(-1, (H, K)))  # [B, T, H, V]
        return self.o_proj(o.flatten(-2))

    def recurrence(self, q, k, v, z, beta, cache: KDAStateView | None, cu_seqlens) -> torch.Tensor:
        """The delta rule over q, k, v [B, T, H, K], raw gate z [B, T, H, K] and beta logits [B, T, H], from and into
        the cache view's states (module docstring of k3.model.cache). Returns o [B, T, H, V]."""
        kw = self.kernel_kwargs()
        chunk_kw = {"chunk_size": self.chunk_size, "safe_gate": self.lower_bound is not None}
        if cache is None:  # training: no state in or out
            return chunk_kda(q, k, v, z, beta, cu_seqlens=cu_seqlens, **chunk_kw, **kw)[0]
        max_len = q.shape[1] if cache.max_len is None else cache.max_len
        recurrent = not self.training and max_len <= RECURRENT_MAX_TOKENS and cache.allow_recurrent
        slots = cache.slots
        if slots is None:  # contiguous: rows 0..N-1, the state replaced by the kernel's final one
            fn = fused_recurrent_kda if recurrent else partial(chunk_kda, **chunk_kw)
            o, cache.state = fn(q, k, v, z, beta, initial_state=cache.state, output_final_state=True,
                                cu_seqlens=cu_seqlens, **kw)
            return o
        if recurrent and cu_seqlens is None:  # B rows of T tokens in place on the pool, no host reads
            o = fused_recurrent_kda_pool_trusted(q, k, v, z, beta, pool=cache.state, ssm_state_indices=slots, **kw)
            cache.state_done(None, None)
            return o
        if recurrent:  # packed sequences, in place on the pool
            o, _ = fused_recurrent_kda(q, k, v, z, beta, initial_state=cache.state, ssm_state_indices=slots,
                                       cu_seqlens=cu_seqlens, **kw)
            cache.state_done(None, None)
            return o
        out = chunk_kda(q, k, v, z, beta, initial_state=cache.state[slots], output_final_state=True,
                        return_intermediate_states=cache.chunk_states, cu_seqlens=cu_seqlens,
                        cu_seqlens_cpu=cache.cu_seqlens_cpu, **chunk_kw, **kw)
        cache.state[slots] = out[1]
        cache.state_done(out[1], out[2] if cache.chunk_states else None)
        return out[0]
