"""Tests for k3.model.mla (architecture.md section 6, 11.3): a float64 per-head reference written here, absorbed decode,
latent cache, NoPE/RoPE behaviour, max-logit tracking and the QK-Clip weight layout.

Legend: B batch, T tokens, H heads, N nope dim, R rope dim, V value dim, C kv_lora_rank, D model width.
"""

import dataclasses
import math

import pytest
import torch

from k3.model.cache import MLACache
from k3.model.config import ModelConfig
from k3.model.mla import GatedMLA, mla_absorbed_attention

B, T = 2, 7


def make(position="rope", **overrides) -> GatedMLA:
    cfg = dataclasses.replace(ModelConfig(), mla_position=position, **overrides).validate()
    mod = GatedMLA(cfg)
    # Default init gives tiny logits; a larger query scale makes attention patterns (and position effects) visible.
    with torch.no_grad():
        mod.q_b_proj.weight.mul_(4.0)
        mod.kv_b_proj.weight.mul_(2.0)
    return mod


# ---------------------------------------------------------------------------------------------------- naive reference


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope_pairs(v_R, pos, theta):
    """Explicit rotate-half RoPE of one vector: element i pairs with i + R/2 at angle pos·theta^(-2i/R)."""
    R = v_R.shape[0]
    half = R // 2
    out = v_R.clone()
    for i in range(half):
        ang = pos * theta ** (-2.0 * i / R)
        c, s = math.cos(ang), math.sin(ang)
        out[i] = v_R[i] * c - v_R[i + half] * s
        out[i + half] = v_R[i + half] * c + v_R[i] * s
    return out


def naive_mla(mod: GatedMLA, x_BTD: torch.Tensor, position: str | None = None):
    """float64 reference with per-head, per-query loops. Returns (y [B, T, D], logits [B, H, T, T] with -inf masked)."""
    position = mod.position if position is None else position
    p = {k: v.detach().double() for k, v in mod.state_dict().items()}
    x = x_BTD.double()
    Bx, Tx, _ = x.shape
    H, N, R, V, C = mod.num_heads, mod.nope_dim, mod.rope_dim, mod.v_dim, mod.kv_lora_rank
    eps = mod.q_a_layernorm.eps
    cq = _rms(x @ p["q_a_proj.weight"].T, p["q_a_layernorm.weight"], eps)
    q = (cq @ p["q_b_proj.weight"].T).view(Bx, Tx, H, N + R)
    a = x @ p["kv_a_proj_with_mqa.weight"].T
    ckv = _rms(a[..., :C], p["kv_a_layernorm.weight"], eps)
    kr = a[..., C:]
    kvb = (ckv @ p["kv_b_proj.weight"].T).view(Bx, Tx, H, N + V)
    y = torch.zeros(Bx, Tx, H * V, dtype=torch.float64)
    logits = torch.full((Bx, H, Tx, Tx), float("-inf"), dtype=torch.float64)
    for b in range(Bx):
        krot = [(_rope_pairs(kr[b, j], j, mod.rope_theta) if position == "rope" and R else kr[b, j]) for j in range(Tx)]
        for h in range(H):
            for t in range(Tx):
                qn, qr = q[b, t, h, :N], q[b, t, h, N:]
                if position == "rope" and R:
                    qr = _rope_pairs(qr, t, mod.rope_theta)
                s = torch.stack([qn @ kvb[b, j, h, :N] + qr @ krot[j] for j in range(t + 1)]) / math.sqrt(N + R)
                logits[b, h, t, : t + 1] = s
                w = torch.softmax(s, 0)
                y[b, t, h * V:(h + 1) * V] = sum(w[j] * kvb[b, j, h, N:] for j in range(t + 1))
    if mod.g_proj is not None:
        y = y * torch.sigmoid(x @ p["g_proj.weight"].T)
    return y @ p["o_proj.weight"].T, logits


# ---------------------------------------------------------------------------------------------------- train mode


@pytest.mark.parametrize("position", ["rope", "nope"])
def test_train_mode_matches_naive_reference(position):
    mod = make(position)
    x = torch.randn(B, T, mod.d_model)
    y_ref, _ = naive_mla(mod, x)
    torch.testing.assert_close(mod(x).double(), y_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides", [{"qk_rope_head_dim": 0}, {"mla_use_output_gate": False}],
                         ids=["rope0", "nogate"])
@pytest.mark.parametrize("position", ["rope", "nope"])
def test_variants_match_naive_reference(position, overrides):
    mod = make(position, **overrides)
    assert (mod.g_proj is None) == (overrides.get("mla_use_output_gate") is False)
    x = torch.randn(B, T, mod.d_model)
    y_ref, _ = naive_mla(mod, x)
    torch.testing.assert_close(mod(x).double(), y_ref, rtol=1e-5, atol=1e-5)
    cache = MLACache()
    y = torch.cat([mod(x[:, :4], cache), mod(x[:, 4:5], cache), mod(x[:, 5:], cache)], dim=1)
    assert cache.kv.shape == (B, T, mod.kv_lora_rank + mod.rope_dim)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)


def test_gradients_reach_every_parameter():
    mod = make("rope")
    x = torch.randn(B, T, mod.d_model, requires_grad=True)
    mod(x).square().sum().backward()
    for name, prm in mod.named_parameters():
        assert prm.grad is not None and torch.isfinite(prm.grad).all() and prm.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------- cache and decode


def test_absorbed_attention_function_matches_mha():
    """mla_absorbed_attention on hand-built tensors equals per-head MHA with k_nope = W_UK c, v = W_UV c (float64)."""
    H, N, R, V, C, S, Tq = 3, 5, 4, 6, 7, 9, 4
    dt = torch.float64
    q_nope, q_rope = torch.randn(B, Tq, H, N, dtype=dt), torch.randn(B, Tq, H, R, dtype=dt)
    w_uk, w_uv = torch.randn(H, N, C, dtype=dt), torch.randn(H, V, C, dtype=dt)
    kv = torch.randn(B, S, C + R, dtype=dt)
    scale = 1 / math.sqrt(N + R)
    q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)
    o_lat, m_H = mla_absorbed_attention(q_lat, q_rope, kv, scale, return_max_logit=True)
    o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv)
    c, kr = kv[..., :C], kv[..., C:]
    ref = torch.zeros(B, Tq, H, V, dtype=dt)
    best = torch.full((H,), -math.inf, dtype=dt)
    for b in range(B):
        for h in range(H):
            k_nope, v = c[b] @ w_uk[h].T, c[b] @ w_uv[h].T  # [S, N], [S, V]
            for t in range(Tq):
                n_keys = S - Tq + t + 1  # causal among the new tokens
                s = (k_nope[:n_keys] @ q_nope[b, t, h] + kr[b, :n_keys] @ q_rope[b, t, h]) * scale
                best[h] = max(best[h], s.max())
                ref[b, t, h] = torch.softmax(s, 0) @ v[:n_keys]
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(m_H.double(), best, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("position", ["rope", "nope"])
def test_absorbed_decode_matches_naive_fp32(position):
    mod = make(position)
    x = torch.randn(B, T, mod.d_model)
    y_ref, _ = naive_mla(mod, x)
    cache = MLACache()
    mod(x[:, : T - 1], cache)
    y_last = mod(x[:, T - 1:], cache)
    assert (y_last.double() - y_ref[:, T - 1:]).abs().max() < 1e-5


def test_cache_shape_and_growth():
    mod = make("rope")
    x = torch.randn(B, T, mod.d_model)
    cache = MLACache()
    assert cache.length == 0
    mod(x[:, :5], cache)
    assert cache.kv.shape == (B, 5, mod.kv_lora_rank + mod.rope_dim)
    prefix = cache.kv.clone()
    mod(x[:, 5:6], cache)
    assert cache.kv.shape == (B, 6, mod.kv_lora_rank + mod.rope_dim)
    mod(x[:, 6:], cache)
    assert cache.length == T
    assert torch.equal(cache.kv[:, :5], prefix)  # appending never rewrites the past


@pytest.mark.parametrize("position", ["rope", "nope"])
def test_prefill_then_decode_equals_full_forward(position):
    mod = make(position)
    x = torch.randn(B, T, mod.d_model)
    y_full = mod(x)
    cache = MLACache()
    ys = [mod(x[:, :3], cache)] + [mod(x[:, t:t + 1], cache) for t in range(3, T)]
    torch.testing.assert_close(torch.cat(ys, 1), y_full, rtol=1e-5, atol=1e-5)
    # two chunks: the second (4 tokens, causal among themselves) goes through the absorbed path
    cache2 = MLACache()
    y2 = torch.cat([mod(x[:, :3], cache2), mod(x[:, 3:], cache2)], 1)
    torch.testing.assert_close(y2, y_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache2.kv, cache.kv, rtol=1e-6, atol=1e-6)


def test_cache_stores_rotated_k_rope_in_rope_mode_only():
    x = torch.randn(B, T, 64)
    for position in ("rope", "nope"):
        mod = make(position)
        cache = MLACache()
        mod(x, cache)
        raw = mod.kv_a_proj_with_mqa(x)[..., mod.kv_lora_rank:]
        same = torch.allclose(cache.kv[..., mod.kv_lora_rank:], raw, atol=1e-6)
        assert same == (position == "nope")


def test_bad_inputs_raise_clear_errors():
    mod = make("rope")
    with pytest.raises(ValueError, match=r"\[B, T, 64\]"):
        mod(torch.randn(B, T, 32))
    with pytest.raises(ValueError, match="MLACache.kv"):
        mod(torch.randn(B, 1, 64), MLACache(torch.randn(B, 3, 17)))
    with pytest.raises(ValueError, match="even"):
        GatedMLA(dataclasses.replace(ModelConfig(), qk_rope_head_dim=7))


# ---------------------------------------------------------------------------------------------------- positions


def _last_output_after_permuting_prefix(mod, x):
    perm = torch.randperm(T - 1)
    while torch.equal(perm, torch.arange(T - 1)):
        perm = torch.randperm(T - 1)
    x_perm = torch.cat([x[:, perm], x[:, T - 1:]], dim=1)
    return mod(x)[:, -1], mod(x_perm)[:, -1]


def test_nope_last_output_invariant_to_prefix_permutation():
    x = torch.randn(B, T, 64)
    a, b = _last_output_after_permuting_prefix(make("nope"), x)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    a, b = _last_output_after_permuting_prefix(make("rope"), x)
    assert (a - b).abs().max() > 1e-4


def test_rope_slot_is_scored_in_nope_mode():
    mod = make("nope")
    x = torch.randn(B, T, mod.d_model)
    y = mod(x)
    N, E = mod.nope_dim, mod.qk_head_dim
    with torch.no_grad():
        for h in range(mod.num_heads):
            mod.q_b_proj.weight[h * E + N:(h + 1) * E].zero_()
    assert (mod(x) - y).abs().max() > 1e-4


def test_position_flip_to_nope_is_honoured():
    rope, nope = make("rope"), make("nope")
    nope.load_state_dict(rope.state_dict())
    x = torch.randn(B, T, 64)
    rope.position = "nope"
    torch.testing.assert_close(rope(x), nope(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------- max logit / QK-Clip


@pytest.mark.parametrize("position", ["rope", "nope"])
def test_max_logit_matches_brute_force_and_leaves_output_unchanged(position):
    mod = make(position)
    x = torch.randn(B, T, mod.d_model)
    y_off = mod(x)
    mod.track_max_logit = True
    y_on = mod(x)
    assert torch.equal(y_on, y_off)
    assert mod.max_logit_per_head.dtype == torch.float32 and mod.max_logit_per_head.shape == (mod.num_heads,)
    _, logits = naive_mla(mod, x)
    torch.testing.assert_close(mod.max_logit_per_head.double(), logits.amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-5)
    # absorbed decode tracks the max over the new query's row (all of its past keys)
    cache = MLACache()
    mod(x[:, : T - 1], cache)
    mod(x[:, T - 1:], cache)
    torch.testing.assert_close(mod.max_logit_per_head.double(), logits[:, :, T - 1].amax(dim=(0, 2)),
                               rtol=1e-5, atol=1e-5)


def test_max_logit_chunked_over_queries(monkeypatch):
    import k3.kernels.mla.naive as mla_mod

    mod = make("rope")
    mod.track_max_logit = True
    x = torch.randn(B, T, mod.d_model)
    mod(x)
    whole = mod.max_logit_per_head.clone()
    monkeypatch.setattr(mla_mod, "_MAX_LOGIT_CHUNK_ELEMS", 1)  # one query row per chunk
    mod(x)
    # the same dot products, but a one-row matmul may block its sums differently from the whole one (a clean-clone
    # CI run differed by 1 ulp: 4.8e-7 at 3.9): equal to a few fp32 ulps, not bit for bit
    torch.testing.assert_close(mod.max_logit_per_head, whole, rtol=1e-6, atol=0)


def test_max_logit_buffer_stays_fp32_after_dtype_cast():
    mod = make("rope").to(torch.bfloat16)
    mod.track_max_logit = True
    mod(torch.randn(B, T, 64, dtype=torch.bfloat16))
    assert mod.max_logit_per_head.dtype == torch.float32
    assert "max_logit_per_head" not in mod.state_dict()


@pytest.mark.parametrize("position", ["rope", "nope"])
def test_qk_clip_layout_in_docstring_scales_one_head(position):
    """Scaling rows as the module docstring says multiplies head h's logits by gamma and leaves other heads alone."""
    mod = make(position).double()  # float64 weights: the row scaling itself adds no rounding
    mod.track_max_logit = True
    x = torch.randn(B, T, mod.d_model, dtype=torch.float64)
    _, before = naive_mla(mod, x)
    h, gamma = 1, 0.3
    N, V, E = mod.nope_dim, mod.v_dim, mod.qk_head_dim
    with torch.no_grad():
        mod.q_b_proj.weight[h * E:h * E + N] *= math.sqrt(gamma)
        mod.kv_b_proj.weight[h * (N + V):h * (N + V) + N] *= math.sqrt(gamma)
        mod.q_b_proj.weight[h * E + N:(h + 1) * E] *= gamma
    _, after = naive_mla(mod, x)
    valid = torch.isfinite(before)
    torch.testing.assert_close(after[:, h][valid[:, h]], gamma * before[:, h][valid[:, h]], rtol=1e-9, atol=1e-12)
    others = [i for i in range(mod.num_heads) if i != h]
    torch.testing.assert_close(after[:, others], before[:, others], rtol=0, atol=0)
    mod(x)
    torch.testing.assert_close(mod.max_logit_per_head.double(), after.amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-5)
