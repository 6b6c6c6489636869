"""Counted bytes of expert-parallel dispatch: latent (K3) against full-width all-to-all (docs/parallel.md).

Per token and MoE layer, the forward sends each of its K (token, expert) rows to the expert's rank and the expert's
output back (Megatron-style, one row per pair, no per-rank de-duplication). Stable LatentMoE routes on x but runs the
experts on W_down x, and normalises the weighted sum before W_up on the token's own rank, so both directions carry
width l = moe_latent_size; a full-width MoE carries d = d_model both ways. With routing balanced over P ranks a row
stays local with probability 1 / P, so

    bytes per token and layer = 2 (dispatch + combine) * K * width * dtype_bytes * (P - 1) / P,

latent / full = l / d. The backward sends the same volumes again (gradients of both all-to-alls). Not counted: the
per-step exchange of split sizes (P int64 per rank), independent of tokens. K3: l = d / 2 at top-16 sends exactly
what K2 sent at full width d with top-8 (16 * 3584 = 8 * 7168).
"""

from __future__ import annotations

from k3.model.config import ModelConfig


def ep_dispatch_bytes(model: ModelConfig, ep: int, dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes per token of one training step's EP all-to-alls, latent and full width, for `ep` ranks.

    Returns {"latent_layer", "full_layer"} (one MoE layer's forward, per token), {"latent_step", "full_step"} (all
    MoE layers, forward + backward, per token) and "ratio" (latent / full). Example with k3-debug (d 64, l 32, K 2,
    3 MoE layers), ep=2, bf16: latent_layer = 2 * 2 * 32 * 2 * 1/2 = 128 bytes, full_layer 256, ratio 0.5.
    """
    if ep < 1:
        raise ValueError(f"EP size must be >= 1, got {ep}")
    if dtype_bytes not in (1, 2, 4):
        raise ValueError(f"dtype_bytes must be 1 (fp8), 2 (bf16) or 4 (fp32), got {dtype_bytes}")
    remote = (ep - 1) / ep
    per_width = 2 * model.num_experts_per_tok * dtype_bytes * remote
    moe_layers = model.mlp_types.count("moe")
    latent, full = per_width * model.moe_latent_size, per_width * model.d_model
    return {"latent_layer": latent, "full_layer": full, "latent_step": 2 * moe_layers * latent,
            "full_step": 2 * moe_layers * full, "ratio": model.moe_latent_size / model.d_model}
