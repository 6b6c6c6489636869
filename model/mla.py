"""Gated Multi-head Latent Attention (architecture.md section 6), the global-attention layer of the K3 hybrid.

Features:
- DeepSeek-V2/V3 MLA (arXiv 2405.04434 section 2.1, arXiv 2412.19437): low-rank query, a shared compressed latent
  c_kv per token, and a shared per-token key slot k_rope; RMSNorm after each down-projection.
- Position mode `position` ∈ {"rope", "nope"}: "rope" rotates q_rope and the shared k_rope at their absolute positions
  (RoPE, Su et al. arXiv 2104.09864, rotate-half convention); "nope" (K3, extend-context) leaves the slot unrotated
  but STILL scores it: dropping q_rope·k_rope is a known silent bug (architecture.md 6.1).
- Output gate (K3): o ← o ⊙ σ(g_proj(x)) per head-channel, before o_proj.
- Training / prefill: "MHA mode" through `torch.nn.functional.scaled_dot_product_attention(is_causal=True)`.
- Decode / chunked-prefill continuation: "absorbed" (MQA) mode over the latent cache [c_kv ; k_rope]
  (architecture.md 6.2), see `mla_absorbed_attention`; the serving engine's paged latent pool through a
  `PagedLatentView` (k3.kernels.mla.paged_mla_decode).
- Per-head max pre-softmax logit for QK-Clip and logging (`track_max_logit`), never changing the output.

Weight layout (fixed; QK-Clip in k3.train.optim relies on it). N = qk_nope_head_dim, R = qk_rope_head_dim,
V = v_head_dim, C = kv_lora_rank, Q = q_lora_rank, H heads, D = d_model; `nn.Linear.weight` is [out, in]:
    q_a_proj            [Q, D]              c_q = q_a_layernorm(q_a_proj(x))
    q_b_proj            [H*(N+R), Q]        rows of head h: h*(N+R) + [0, N) = W^{UQ}_h (nope), h*(N+R) + [N, N+R) = W^{QR}_h
    kv_a_proj_with_mqa  [C+R, D]            rows [0, C) = W^{DKV} (then kv_a_layernorm), rows [C, C+R) = shared W^{KR}
    kv_b_proj           [H*(N+V), C]        rows of head h: h*(N+V) + [0, N) = W^{UK}_h, h*(N+V) + [N, N+V) = W^{UV}_h
    g_proj              [H*V, D]            output gate (only when cfg.mla_use_output_gate)
    o_proj              [D, H*V]

QK-Clip (Kimi K2, arXiv 2507.20534 section 2.1; architecture.md 11.3): with S_max^h = `max_logit_per_head[h]` and
gamma = tau / S_max^h for a head with S_max^h > tau:
    q_b_proj rows h*(N+R) + [0, N)      *= sqrt(gamma)    (nope query)
    kv_b_proj rows h*(N+V) + [0, N)     *= sqrt(gamma)    (nope key; q^C·k^C scales by gamma)
    q_b_proj rows h*(N+R) + [N, N+R)    *= gamma          (per-head rope query; q^R·k^R scales by gamma)
    kv_a_proj_with_mqa rows [C, C+R)    untouched         (k_rope is shared by all heads)
    kv_b_proj rows of W^{UV}_h          untouched
Because RMSNorm sits before q_b_proj / kv_b_proj, these row scalings scale the logits exactly (in both position
modes: rotation is linear and per position).

Legend: B batch, T new tokens, S keys (cached + new), H heads, N nope dim, R rope dim, E = N + R, V value dim,
C kv_lora_rank, W = C + R cache width, X a packed width named where used, D model width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3.kernels.dispatch import kernel_backend
from k3.kernels.mla import causal_max_logit, paged_mla_decode, warm_up_paged_mla_decode
from k3.model.cache import MLACache, PagedLatentView
from k3.model.config import ModelConfig
from k3.model.layers import RMSNorm


def rope_cos_sin(positions_T: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables [T, R] for RoPE at integer `positions_T` [T] (rotate-half layout: frequencies repeated).

    inv_freq_i = theta^(-2i/R), i < R/2 (Su et al., arXiv 2104.09864, eq. 15).
    Example: cos, sin = rope_cos_sin(torch.arange(5), 8, 1e4)  # each [5, 8]
    """
    if rope_dim % 2:
        raise ValueError(f"RoPE needs an even rope dim, got qk_rope_head_dim={rope_dim}; use an even value or 'nope'")
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, device=positions_T.device, dtype=torch.float32) / rope_dim)
    freqs_TR2 = positions_T.to(torch.float32)[:, None] * inv_freq[None, :]
    emb_TR = torch.cat([freqs_TR2, freqs_TR2], dim=-1)
    return emb_TR.cos(), emb_TR.sin()


def apply_rope(x: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, ..., R] by position (dim 1 is time): x·cos + rotate_half(x)·sin in fp32 (or x's wider dtype).

    rotate_half([x1, x2]) = [-x2, x1] on the two halves of the last dim.
    Example: apply_rope(q_BTHR, *rope_cos_sin(torch.arange(T), R, 1e4))
    """
    shape = (1, cos_TR.shape[0]) + (1,) * (x.dim() - 3) + (cos_TR.shape[1],)
    cos, sin = cos_TR.view(shape), sin_TR.view(shape)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def mla_absorbed_attention(q_latent_BTHC: torch.Tensor, q_rope_BTHR: torch.Tensor, kv_BSW: torch.Tensor,
                           softmax_scale: float, q_start: int | None = None,
                           return_max_logit: bool = False):
    """Absorbed ("MQA mode") MLA attention over the latent cache (architecture.md 6.2).

    Logit of head h, query t, key j: scale · (q_latent[t,h]·c_kv[j] + q_rope[t,h]·k_rope[j]), where
    q_latent = (W^{UK}_h)^T q_nope (so q_latent·c_kv = q_nope·k_nope exactly) and kv = [c_kv ; k_rope] is shared by all
    heads. The value is c_kv itself; the caller applies W^{UV}_h afterwards.

    Args:
        q_latent_BTHC: [B, T, H, C] queries projected into the latent.
        q_rope_BTHR: [B, T, H, R] rope-slot queries (already rotated in rope mode); R may be 0.
        kv_BSW: [B, S, C + R] cache INCLUDING the T new tokens at its end.
        softmax_scale: usually 1 / sqrt(N + R) (the MHA head dim, not C + R).
        q_start: absolute position of the first query (default S - T); query t sees keys 0 .. q_start + t.
        return_max_logit: also return the per-head max scaled logit over valid pairs, fp32 [H].
    Returns:
        o_latent [B, T, H, C] in q's dtype (softmax in fp32 or wider), or (o_latent, max_logit_H).
    Example: o = mla_absorbed_attention(q_lat, q_rope, cache.kv, 1 / math.sqrt(24))
    """
    T, C = q_latent_BTHC.shape[1], q_latent_BTHC.shape[3]
    S, W = kv_BSW.shape[1], kv_BSW.shape[2]
    R = q_rope_BTHR.shape[-1]
    if W != C + R:
        raise ValueError(f"latent cache width {W} != kv_lora_rank {C} + qk_rope_head_dim {R}; the cache was built by a "
                         "layer with a different config")
    q_start = S - T if q_start is None else q_start
    if q_start < 0 or q_start + T > S:
        raise ValueError(f"queries at positions [{q_start}, {q_start + T}) do not fit a cache of {S} tokens")
    c_kv_BSC, k_rope_BSR = kv_BSW.split([C, R], dim=-1)
    # Both terms are products against keys shared by all heads (MQA): one matmul each with heads folded into rows.
    logits_BHTS = torch.einsum("bthc,bsc->bhts", q_latent_BTHC, c_kv_BSC)
    if R > 0:
        logits_BHTS = logits_BHTS + torch.einsum("bthr,bsr->bhts", q_rope_BTHR, k_rope_BSR)
    # softmax in at least fp32 (bf16 logits lose the small differences that decide the weights)
    logits_BHTS = logits_BHTS.to(torch.promote_types(logits_BHTS.dtype, torch.float32)) * softmax_scale
    q_pos_T = q_start + torch.arange(T, device=kv_BSW.device)
    valid_TS = torch.arange(S, device=kv_BSW.device)[None, :] <= q_pos_T[:, None]
    logits_BHTS = logits_BHTS.masked_fill(~valid_TS, float("-inf"))
    probs_BHTS = torch.softmax(logits_BHTS, dim=-1).to(q_latent_BTHC.dtype)
    o_latent_BTHC = torch.einsum("bhts,bsc->bthc", probs_BHTS, c_kv_BSC)
    if return_max_logit:
        return o_latent_BTHC, logits_BHTS.detach().amax(dim=(0, 2, 3)).float()
    return o_latent_BTHC


def causal_sdpa(q_BTHE: torch.Tensor, k_BTHE: torch.Tensor, v_BTHV: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal MHA over T tokens via F.scaled_dot_product_attention; returns [B, T, H, V].

    The qk head dim E = N + R differs from V. The CPU math backend accepts that, and so do the CUDA memory-efficient
    and cuDNN backends, but the flash backend requires one head dim (<= 256) for q, k and v (checked with torch 2.11
    on an H200: "Flash attention requires q,k,v to have the same last dimension"). So on CUDA v is zero-padded to E
    (zero columns add nothing to p·v) and the output sliced back, which keeps flash eligible for bf16/fp16.
    Example: o = causal_sdpa(q, k, v, 1 / math.sqrt(q.shape[-1]))
    """
    E, V = q_BTHE.shape[-1], v_BTHV.shape[-1]
    pad = q_BTHE.is_cuda and V < E
    if pad:
        v_BTHV = F.pad(v_BTHV, (0, E - V))
    o_BHTX = F.scaled_dot_product_attention(q_BTHE.transpose(1, 2), k_BTHE.transpose(1, 2), v_BTHV.transpose(1, 2),
                                            is_causal=True, scale=scale)
    o_BTHX = o_BHTX.transpose(1, 2)
    return o_BTHX[..., :V] if pad else o_BTHX


def paged_attention_bounded(device: torch.device) -> bool:
    """True when paged attention (a PagedLatentView) reads each query's keys up to its position only (the Triton
    kernel on CUDA), so a block table may be as wide as the pool allows at no cost; False on its PyTorch twin, which
    gathers every page of the table."""
    return device.type == "cuda" and kernel_backend() == "triton"


def warm_up_paged_attention(kv_pool_PSX: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype) -> None:
    """Compile the paged attention kernel's variants for this pool and the model's head shape now (serving warm-up,
    before the first request); no-op on the PyTorch backend."""
    warm_up_paged_mla_decode(kv_pool_PSX, cfg.mla_num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype)


class GatedMLA(nn.Module):
    """Gated MLA layer: x [B, T, D] -> [B, T, D], optionally reading/extending an MLACache.

    Attributes: `num_heads` (H); `position` ("rope" | "nope", a plain attribute extend-context may flip);
    `track_max_logit` (bool); buffer `max_logit_per_head` [H] fp32, non-persistent, OVERWRITTEN by every forward while
    tracking (a training loop with gradient accumulation takes the max over its micro-batches itself).
    Example: y = GatedMLA(ModelConfig())(torch.randn(2, 8, 64))
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        if cfg.mla_position not in ("rope", "nope"):
            raise ValueError(f"model.mla_position must be 'rope' or 'nope', got {cfg.mla_position!r}")
        if cfg.mla_position == "rope" and cfg.qk_rope_head_dim % 2:
            raise ValueError(f"model.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even for rope mode")
        self.layer_idx = layer_idx
        self.d_model = cfg.d_model
        self.num_heads = H = cfg.mla_num_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.softmax_scale = 1.0 / math.sqrt(self.qk_head_dim)
        self.rope_theta = cfg.rope_theta
        self.position = cfg.mla_position
        self.track_max_logit = False

        self.q_a_proj = nn.Linear(cfg.d_model, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.d_model, cfg.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.g_proj = nn.Linear(cfg.d_model, H * self.v_dim, bias=False) if cfg.mla_use_output_gate else None
        self.o_proj = nn.Linear(H * self.v_dim, cfg.d_model, bias=False)
        self.register_buffer("max_logit_per_head", torch.zeros(H, dtype=torch.float32), persistent=False)

    def _check_inputs(self, x: torch.Tensor, cache) -> None:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"GatedMLA expects x of shape [B, T, {self.d_model}], got {tuple(x.shape)}")
        if x.shape[1] == 0:
            raise ValueError("GatedMLA got T = 0 tokens; call it with at least one token")
        if self.position not in ("rope", "nope"):
            raise ValueError(f"GatedMLA.position must be 'rope' or 'nope', got {self.position!r}")
        if isinstance(cache, MLACache) and cache.kv is not None:
            width = self.kv_lora_rank + self.rope_dim
            if cache.kv.dim() != 3 or cache.kv.shape[0] != x.shape[0] or cache.kv.shape[2] != width:
                raise ValueError(f"MLACache.kv must be [B={x.shape[0]}, T_cached, {width}], got {tuple(cache.kv.shape)};"
                                 " use a fresh MLACache() per layer and sequence batch")

    def _record_max_logit(self, m_H: torch.Tensor) -> None:
        if self.max_logit_per_head.dtype == torch.float32 and self.max_logit_per_head.shape == m_H.shape:
            self.max_logit_per_head.copy_(m_H)
        else:  # the module was cast (e.g. .to(bfloat16)); keep the statistic in fp32
            self.max_logit_per_head = m_H.float().clone()

    def project(self, x: torch.Tensor, positions: torch.Tensor | None):
        """The projections of x [B, T, D] (architecture.md 6.1): q_nope [B, T, H, N], q_rope [B, T, H, R], the
        normalized latent c_kv [B, T, C] and the shared k_rope [B, T, R], both rope slots rotated at `positions`
        (broadcast over dim 1: [T], or [B * T] flattened for B rows of T) in rope mode."""
        B, T, _ = x.shape
        H, N, R, C = self.num_heads, self.nope_dim, self.rope_dim, self.kv_lora_rank
        q_nope_BTHN, q_rope_BTHR = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, H, N + R).split(
            [N, R], dim=-1)
        c_kv_BTC, k_rope_BTR = self.kv_a_proj_with_mqa(x).split([C, R], dim=-1)
        c_kv_BTC = self.kv_a_layernorm(c_kv_BTC)
        if self.position == "rope" and R > 0:
            cos, sin = rope_cos_sin(positions, R, self.rope_theta)
            if positions.shape[0] != T:  # one position per flattened row: rotate as [1, B * T, ...]
                q_rope_BTHR = apply_rope(q_rope_BTHR.reshape(1, B * T, H, R), cos, sin).view(B, T, H, R)
                k_rope_BTR = apply_rope(k_rope_BTR.reshape(1, B * T, R), cos, sin).view(B, T, R)
            else:
                q_rope_BTHR, k_rope_BTR = apply_rope(q_rope_BTHR, cos, sin), apply_rope(k_rope_BTR, cos, sin)
        return q_nope_BTHN, q_rope_BTHR, c_kv_BTC, k_rope_BTR

    def absorb_query(self, q_nope_BTHN: torch.Tensor) -> torch.Tensor:
        """q_latent [B, T, H, C] = (W^{UK}_h)^T q_nope per head, so q_latent . c_kv = q_nope . k_nope."""
        H, N, V, C = self.num_heads, self.nope_dim, self.v_dim, self.kv_lora_rank
        w_uk_HNC = self.kv_b_proj.weight.view(H, N + V, C)[:, :N]
        return torch.einsum("bthn,hnc->bthc", q_nope_BTHN, w_uk_HNC)

    def output(self, x: torch.Tensor, o_BTHV: torch.Tensor) -> torch.Tensor:
        """Gate of x [B, T, D] and W_o over the per-head outputs o [B, T, H, V] -> [B, T, D]."""
        B, T = x.shape[:2]
        o_BTX = o_BTHV.reshape(B, T, self.num_heads * self.v_dim)
        if self.g_proj is not None:
            o_BTX = o_BTX * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o_BTX)

    def latent_output(self, x: torch.Tensor, o_latent_BTHC: torch.Tensor) -> torch.Tensor:
        """Absorbed mode's output: W^{UV}_h applied to the latent outputs [B, T, H, C], then `output`."""
        H, N, V, C = self.num_heads, self.nope_dim, self.v_dim, self.kv_lora_rank
        w_uv_HVC = self.kv_b_proj.weight.view(H, N + V, C)[:, N:]
        return self.output(x, torch.einsum("bthc,hvc->bthv", o_latent_BTHC, w_uv_HVC))

    def forward(self, x: torch.Tensor, cache: MLACache | PagedLatentView | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D], through a latent cache view (k3.model.cache) when given:

        - none, or an empty MLACache: MHA mode (training / first prefill; the MLACache then holds the latents);
        - a non-empty MLACache: absorbed mode over its latents, the new ones appended (decode, a later chunk);
        - a PagedLatentView: the new latents written into the pages, absorbed mode through the block tables.
        Example: cache = MLACache(); y1 = layer(x[:, :5], cache); y2 = layer(x[:, 5:], cache)  # == layer(x)
        """
        self._check_inputs(x, cache)
        if cache is not None and not isinstance(cache, MLACache):
            return self._paged(x, cache)
        B, T, _ = x.shape
        H, N, R, V = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim
        start = 0 if cache is None else cache.length
        positions = torch.arange(start, start + T, device=x.device) if self.position == "rope" and R else None
        q_nope_BTHN, q_rope_BTHR, c_kv_BTC, k_rope_BTR = self.project(x, positions)

        prior_kv = None if cache is None else cache.kv
        if cache is not None:
            new_kv_BTW = torch.cat([c_kv_BTC, k_rope_BTR], dim=-1)
            cache.kv = new_kv_BTW if prior_kv is None else torch.cat([prior_kv, new_kv_BTW.to(prior_kv.dtype)], dim=1)

        if prior_kv is not None:  # absorbed mode: W^{UK}_h folds into the query, W^{UV}_h applies after attention
            q_latent_BTHC = self.absorb_query(q_nope_BTHN)
            out = mla_absorbed_attention(q_latent_BTHC, q_rope_BTHR.to(q_latent_BTHC.dtype), cache.kv,
                                         self.softmax_scale, q_start=start, return_max_logit=self.track_max_logit)
            if self.track_max_logit:
                self._record_max_logit(out[1])
            return self.latent_output(x, out[0] if self.track_max_logit else out)
        # MHA mode: decompress per-head keys and values
        kv_BTHX = self.kv_b_proj(c_kv_BTC).view(B, T, H, N + V)
        k_nope_BTHN, v_BTHV = kv_BTHX.split([N, V], dim=-1)
        k_BTHE = torch.cat([k_nope_BTHN, k_rope_BTR[:, :, None, :].expand(B, T, H, R)], dim=-1)
        q_BTHE = torch.cat([q_nope_BTHN, q_rope_BTHR], dim=-1)
        o_BTHV = causal_sdpa(q_BTHE, k_BTHE, v_BTHV, self.softmax_scale)
        if self.track_max_logit:
            with torch.no_grad():
                self._record_max_logit(causal_max_logit(q_BTHE, k_BTHE, self.softmax_scale, 0))
        return self.output(x, o_BTHV)

    def _paged(self, x: torch.Tensor, view: PagedLatentView) -> torch.Tensor:
        """Absorbed MLA of x [B, T, D] over a paged latent pool: write the new latents [c_kv ; k_rope], then each
        group of the view attends through its block table (k3.kernels.mla.paged_mla_decode)."""
        B, T, _ = x.shape
        H, R, C = self.num_heads, self.rope_dim, self.kv_lora_rank
        q_nope_BTHN, q_rope_BTHR, c_kv_BTC, k_rope_BTR = self.project(x, view.positions)
        q_lat_MHC = self.absorb_query(q_nope_BTHN).flatten(0, 1)  # [M = B * T, H, C]
        q_rope_MHR = q_rope_BTHR.flatten(0, 1).to(q_lat_MHC.dtype)
        view.write(torch.cat([c_kv_BTC, k_rope_BTR], dim=-1).flatten(0, 1))
        if len(view.groups) == 1 and view.groups[0].rows is None:  # every row in one call (the graph steps)
            g = view.groups[0]
            o_lat_MHC = paged_mla_decode(q_lat_MHC.view(g.n, g.t, H, C), q_rope_MHR.view(g.n, g.t, H, R),
                                         view.kv_pool, g.block_table, g.positions, scale=self.softmax_scale,
                                         min_key=view.min_key).flatten(0, 1)
        else:
            o_lat_MHC = torch.empty_like(q_lat_MHC)
            for g in view.groups:  # equal short lengths together, long chunks alone
                o_lat_MHC[g.rows] = paged_mla_decode(
                    q_lat_MHC[g.rows].view(g.n, g.t, H, C), q_rope_MHR[g.rows].view(g.n, g.t, H, R), view.kv_pool,
                    g.block_table, g.positions, scale=self.softmax_scale, min_key=view.min_key).flatten(0, 1)
        return self.latent_output(x, o_lat_MHC.view(B, T, H, C))
