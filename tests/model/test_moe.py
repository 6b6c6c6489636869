"""Stable LatentMoE, sigmoid router and grouped expert dispatch (architecture.md sections 7 and 9.1).

References are written here per token in float64 with explicit formulas (no k3 kernels), so the grouped
permute / grouped-matmul / unpermute path is checked against a plain loop, forward and backward.
"""

import dataclasses

import pytest
import torch
import torch.utils._python_dispatch

from k3.kernels.moe import grouped_mm_available, moe_grouped_mm, moe_permute, moe_unpermute
from k3.model.config import ModelConfig
from k3.model.layers import GatedMLP
from k3.model.moe import LatentMoE, Router

DEBUG = ModelConfig()  # k3-debug: d 64, E 8, K 2, latent 32, expert width 32, 2 shared experts


def cfg_with(**kw):
    return dataclasses.replace(DEBUG, **kw)


# ---------------------------------------------------------------------------------------------------- references


def ref_glu(g, u, act, b1, b2):
    if act == "c2glu":
        return b1 * torch.tanh(g / b1) / (1 + torch.exp(-g)) * b2 * torch.tanh(u / b2)
    return g / (1 + torch.exp(-g)) * u


def ref_rmsnorm(v, w, eps):
    return v / torch.sqrt((v * v).mean() + eps) * w


def ref_route(x_D, W_ED, bias_E, K, scale):
    """One token: sigmoid scores, top-K of biased scores (ties -> lowest index), renormalized unbiased weights."""
    s = 1 / (1 + torch.exp(-(W_ED @ x_D)))
    keys = (s.detach() + bias_E.to(s.dtype)).tolist()
    sel = sorted(range(len(keys)), key=lambda j: (-keys[j], j))[:K]
    p = s[sel] / s[sel].sum() * scale
    return sel, p


def reference_latent_moe(moe: LatentMoE, x_BTD, cfg: ModelConfig):
    """Per-token loop of y = shared(x) + W_up Norm(sum_j p_j Expert_j(W_down x)) from the module's parameters."""
    m, act, b1, b2, eps = cfg.moe_intermediate_size, cfg.hidden_act, cfg.c2glu_beta1, cfg.c2glu_beta2, cfg.rms_norm_eps
    ex = moe.experts
    rows = []
    for x in x_BTD.reshape(-1, x_BTD.shape[-1]):
        sel, p = ref_route(x, moe.gate.weight, moe.gate.e_score_correction_bias, cfg.num_experts_per_tok,
                           cfg.routed_scaling_factor)
        z = moe.fc1_latent_proj.weight @ x
        if cfg.latent_norm_pos == "post_down":
            z = ref_rmsnorm(z, moe.routed_expert_norm.weight, eps)
        agg = 0
        for j, pj in zip(sel, p):
            h = ex.gate_up_proj[j] @ z
            agg = agg + pj * (ex.down_proj[j] @ ref_glu(h[:m], h[m:], act, b1, b2))
        if cfg.latent_norm_pos == "pre_up":
            agg = ref_rmsnorm(agg, moe.routed_expert_norm.weight, eps)
        y = moe.fc2_latent_proj.weight @ agg
        if moe.shared_experts is not None:
            sh = moe.shared_experts
            F2 = sh.gate_up_proj.weight.shape[0] // 2
            h = sh.gate_up_proj.weight @ x
            y = y + sh.down_proj.weight @ ref_glu(h[:F2], h[F2:], act, b1, b2)
        rows.append(y)
    return torch.stack(rows).view_as(x_BTD)


def assert_rel_rms(actual, expected, tol, what=""):
    """Relative-RMS closeness ||a - e|| / ||e|| <= tol (robust to elements near zero)."""
    err = float((actual.detach().double() - expected.detach().double()).norm() / expected.detach().double().norm())
    assert err <= tol, f"{what}: relative RMS error {err:.3g} > {tol:.3g}"


# k3.model.layers.RMSNorm computes in fp32 even for float64 inputs, so float64 comparisons through the latent norm
# are good to ~1e-7 only; without the norm the module is float64 end to end.
NORM_TOL, EXACT_TOL = 1e-6, 1e-12


def make_moe(cfg, dtype=torch.float64, bias_std=0.05):
    moe = LatentMoE(cfg).to(dtype)
    with torch.no_grad():  # non-trivial norm gains and QB bias
        if moe.routed_expert_norm is not None:
            moe.routed_expert_norm.weight.uniform_(0.5, 1.5)
        moe.gate.e_score_correction_bias.normal_(0, bias_std)
    return moe


# ---------------------------------------------------------------------------------------------------- module vs loop


@pytest.mark.parametrize("norm_pos,act", [("pre_up", "c2glu"), ("post_down", "c2glu"), ("none", "c2glu"),
                                          ("pre_up", "swiglu")], ids=lambda v: str(v))
def test_forward_and_grads_match_per_token_reference_float64(norm_pos, act):
    cfg = cfg_with(latent_norm_pos=norm_pos, hidden_act=act, routed_scaling_factor=1.5)
    moe = make_moe(cfg)
    x = (torch.randn(2, 5, cfg.d_model, dtype=torch.float64) * 2).requires_grad_()
    params = [p for p in moe.parameters()] + [x]
    tol = EXACT_TOL if norm_pos == "none" else NORM_TOL
    y = moe(x)
    y_ref = reference_latent_moe(moe, x, cfg)
    assert_rel_rms(y, y_ref, tol, "output")
    g_out = torch.randn_like(y)
    grads = torch.autograd.grad(y, params, g_out)
    grads_ref = torch.autograd.grad(y_ref, params, g_out)
    for (name, _), g, gr in zip(list(moe.named_parameters()) + [("x", x)], grads, grads_ref):
        assert_rel_rms(g, gr, tol, name)


def test_fp32_grouped_path_matches_float64_reference():
    cfg = cfg_with()
    moe = make_moe(cfg, dtype=torch.float32)
    x = torch.randn(2, 16, cfg.d_model)
    moe64 = make_moe(cfg)
    moe64.load_state_dict(moe.state_dict())
    with torch.no_grad():
        assert_rel_rms(moe(x), reference_latent_moe(moe64, x.double(), cfg), 1e-5)


def test_identity_latent_without_norm_equals_standard_moe():
    # latent width = d, W_down = W_up = I, norm off: a standard (DeepSeek-style) MoE with the same experts
    cfg = cfg_with(moe_latent_size=DEBUG.d_model, latent_norm_pos="none")
    moe = make_moe(cfg)
    with torch.no_grad():
        moe.fc1_latent_proj.weight.copy_(torch.eye(cfg.d_model))
        moe.fc2_latent_proj.weight.copy_(torch.eye(cfg.d_model))
    x = torch.randn(3, 4, cfg.d_model, dtype=torch.float64)
    m = cfg.moe_intermediate_size
    ex = moe.experts
    rows = []
    for xt in x.reshape(-1, cfg.d_model):
        sel, p = ref_route(xt, moe.gate.weight, moe.gate.e_score_correction_bias, cfg.num_experts_per_tok, 1.0)
        routed = sum(pj * (ex.down_proj[j] @ ref_glu((ex.gate_up_proj[j] @ xt)[:m], (ex.gate_up_proj[j] @ xt)[m:],
                                                      "c2glu", 4.0, 25.0)) for j, pj in zip(sel, p))
        rows.append(routed + moe.shared_experts(xt[None])[0])
    with torch.no_grad():
        torch.testing.assert_close(moe(x), torch.stack(rows).view_as(x), atol=1e-10, rtol=1e-10)


def test_aggregate_norm_is_scale_invariant_per_layer_not_per_expert():
    cfg = cfg_with(latent_norm_pos="pre_up", rms_norm_eps=1e-12)
    moe = make_moe(cfg)
    x = torch.randn(2, 8, cfg.d_model, dtype=torch.float64)
    with torch.no_grad():
        y0 = moe(x)
        moe.experts.down_proj.mul_(3.7)  # every expert w2 scaled by c > 0
        assert_rel_rms(moe(x), y0, NORM_TOL)
        # scaling ONE expert changes the output: a per-expert norm (the bug this guards against) would hide it
        moe.experts.down_proj[0].mul_(5.0)
        assert float((moe(x) - y0).abs().max()) > 1e-3


def test_shared_experts_see_x_not_the_latent():
    cfg = cfg_with()
    moe = make_moe(cfg)
    x = torch.randn(2, 8, cfg.d_model, dtype=torch.float64)
    with torch.no_grad():
        moe.fc1_latent_proj.weight.zero_()
        shared = moe.shared_experts(x)
        assert float(shared.abs().max()) > 1e-2
        torch.testing.assert_close(moe(x), shared, atol=1e-12, rtol=0)


def test_fused_shared_experts_equal_the_sum_of_two():
    d, m = 16, 8
    fused = GatedMLP(d, 2 * m).double()
    W_gu, W_down = fused.gate_up_proj.weight, fused.down_proj.weight  # [4m, d] = [gate(2m) | up(2m)], [d, 2m]
    x = torch.randn(5, d, dtype=torch.float64)
    total = 0
    for s in range(2):
        one = GatedMLP(d, m).double()
        with torch.no_grad():
            one.gate_up_proj.weight.copy_(torch.cat([W_gu[s * m:(s + 1) * m], W_gu[2 * m + s * m:2 * m + (s + 1) * m]]))
            one.down_proj.weight.copy_(W_down[:, s * m:(s + 1) * m])
        total = total + one(x)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), total, atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------------------------------- router


def test_router_bias_affects_selection_only():
    r = Router(16, 8, 2, routed_scaling_factor=2.5).double()
    x = torch.randn(32, 16, dtype=torch.float64)
    s0, idx0, w0 = r(x)
    assert torch.allclose(w0.sum(-1), torch.full((32,), 2.5, dtype=torch.float64))
    torch.testing.assert_close(w0, s0.gather(1, idx0) / s0.gather(1, idx0).sum(-1, keepdim=True) * 2.5)
    with torch.no_grad():
        r.e_score_correction_bias.copy_(torch.tensor([0, 0, 0, 10.0, 0, 0, 0, 5.0]))
    s1, idx1, w1 = r(x)
    assert torch.equal(s1, s0)  # scores are unbiased
    assert torch.equal(idx1, torch.tensor([[3, 7]]).expand(32, 2))  # the bias forces the selection
    torch.testing.assert_close(w1, s0[:, [3, 7]] / s0[:, [3, 7]].sum(-1, keepdim=True) * 2.5)  # weights from s
    with torch.no_grad():
        r.e_score_correction_bias.add_(0.3)  # a common shift changes nothing
    assert torch.equal(r(x)[1], idx1)


def test_router_ties_break_to_lowest_index():
    r = Router(4, 6, 3)
    with torch.no_grad():
        r.weight.zero_()  # every score is exactly 0.5
    _, idx, w = r(torch.randn(5, 4))
    assert idx.tolist() == [[0, 1, 2]] * 5
    torch.testing.assert_close(w, torch.full((5, 3), 1 / 3))
    with torch.no_grad():  # experts 1 and 4 tie at the top, 2 and 5 tie below them
        r.weight.copy_(torch.tensor([[0.0] * 4, [1.0] * 4, [0.5] * 4, [0.0] * 4, [1.0] * 4, [0.5] * 4]))
    _, idx, _ = r(torch.ones(2, 4))
    assert idx.tolist() == [[1, 4, 2]] * 2


def test_router_bias_stays_fp32_and_persistent():
    moe = LatentMoE(DEBUG)
    assert "gate.e_score_correction_bias" in moe.state_dict()
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.linspace(-1e-3, 1e-3, 8) + 1e-7)
    before = moe.gate.e_score_correction_bias.clone()
    moe.to(torch.bfloat16)
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(moe.gate.e_score_correction_bias, before)
    assert moe.fc1_latent_proj.weight.dtype == torch.bfloat16
    y = moe(torch.randn(2, 4, DEBUG.d_model, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and bool(torch.isfinite(y).all())
    assert not moe.gate.e_score_correction_bias.requires_grad


# ---------------------------------------------------------------------------------------------------- dispatch kernels


def loop_dispatch(x_ND, idx_NK, w_NK, W_EOI):
    """out[n] = sum_k w[n, k] * W[idx[n, k]] @ x[n], token by token."""
    return torch.stack([sum(w_NK[n, k] * (W_EOI[idx_NK[n, k]] @ x_ND[n]) for k in range(idx_NK.shape[1]))
                        for n in range(x_ND.shape[0])])


@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_permute_grouped_mm_unpermute_match_loop(impl):
    N, K, E, I, O = 13, 3, 6, 16, 8
    x = torch.randn(N, I, dtype=torch.float64)
    used = torch.tensor([0, 1, 2, 3, 5])  # expert 4 receives no token (an empty group)
    idx = torch.stack([used[torch.randperm(len(used))[:K]] for _ in range(N)])  # K distinct experts per token
    w = torch.rand(N, K, dtype=torch.float64)
    W = torch.randn(E, O, I, dtype=torch.float64)
    if impl == "grouped":
        if not grouped_mm_available(x.float(), W.float()):
            pytest.skip("torch._grouped_mm unavailable on this build/device")
        x_, w_, W_ = (t.float().requires_grad_() for t in (x, w, W))
    else:
        x_, w_, W_ = (t.clone().requires_grad_() for t in (x, w, W))
    x_MI, order_M, counts_E = moe_permute(x_, idx, E)
    assert counts_E.tolist() == torch.bincount(idx.reshape(-1), minlength=E).tolist() and counts_E[4] == 0
    out = moe_unpermute(moe_grouped_mm(x_MI, W_, counts_E, impl=impl), order_M, w_)
    xr, wr, Wr = (t.clone().requires_grad_() for t in (x, w, W))
    ref = loop_dispatch(xr, idx, wr, Wr)
    g = torch.randn_like(ref)
    tol = {"atol": 1e-10, "rtol": 1e-10} if impl == "loop" else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(out.double(), ref, **tol)
    for a, b in zip(torch.autograd.grad(out, (x_, w_, W_), g.to(out.dtype)), torch.autograd.grad(ref, (xr, wr, Wr), g)):
        torch.testing.assert_close(a.double(), b, **tol)


def earlier_permute(x_ND, idx_NK):
    """The dispatch as first written: expand each token K times, then index by the expert-sorted order."""
    N, K = idx_NK.shape
    order_M = torch.argsort(idx_NK.reshape(-1), stable=True)
    return x_ND.unsqueeze(1).expand(N, K, x_ND.shape[1]).reshape(N * K, -1)[order_M], order_M


def earlier_unpermute(y_MO, order_M, w_NK):
    """The combine as first written: index through the inverse order, then one [1, K] x [K, O] bmm per token."""
    N, K = w_NK.shape
    inv_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(order_M.numel()))
    return torch.bmm(w_NK.unsqueeze(1), y_MO[inv_M].view(N, K, -1)).squeeze(1)


def test_gather_dispatch_and_weighted_sum_equal_the_earlier_formulas_float64():
    """moe_permute / moe_unpermute (gathers both ways, elementwise combine) against the index + bmm formulas:
    values and the gradients of x, y and the routing weights, ties of expert ids and an unused expert included."""
    N, K, E, D, O = 11, 3, 7, 10, 6
    x = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, E - 1, (N, K))  # repeats within a token allowed, expert E-1 never chosen
    w = torch.rand(N, K, dtype=torch.float64, requires_grad=True)
    proj = torch.randn(N * K, D, O, dtype=torch.float64)  # row-dependent map so every slot's gradient differs
    x_MD, order_M, counts_E = moe_permute(x, idx, E)
    x_ref, order_ref = earlier_permute(x, idx)
    assert torch.equal(order_M, order_ref) and torch.equal(x_MD, x_ref) and counts_E[E - 1] == 0
    y = torch.einsum("md,mdo->mo", x_MD, proj)
    y_ref = torch.einsum("md,mdo->mo", x_ref, proj)
    out, ref = moe_unpermute(y, order_M, w), earlier_unpermute(y_ref, order_ref, w)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, w), g), torch.autograd.grad(ref, (x, w), g)):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    y_leaf = y.detach().requires_grad_()
    (gy,) = torch.autograd.grad(moe_unpermute(y_leaf, order_M, w), y_leaf, g)
    (gy_ref,) = torch.autograd.grad(earlier_unpermute(y_leaf, order_M, w), y_leaf, g)
    torch.testing.assert_close(gy, gy_ref, rtol=1e-13, atol=1e-13)


class OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Names of the aten ops that run inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# scatters (index_put sorts its indices on CUDA; float scatter-adds are atomics), the small-tile bmm, host syncs
FORBIDDEN = {"index_put", "index_put_", "_index_put_impl_", "index_add", "index_add_", "scatter_add", "bmm",
             "nonzero", "_local_scalar_dense", "masked_select"}


def test_dispatch_runs_no_scatter_bmm_or_host_sync_forward_or_backward():
    N, K, E, D = 24, 3, 6, 16
    x = torch.randn(N, D, requires_grad=True)
    w = torch.rand(N, K, requires_grad=True)
    W = torch.randn(E, 8, D, requires_grad=True)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    moe_grouped_mm(torch.randn(4, D), W.detach(), torch.tensor([1, 1, 1, 1, 0, 0]))  # the one-time probe, outside
    with OpLog() as fwd:
        x_MD, order_M, counts_E = moe_permute(x, idx, E)
        out = moe_unpermute(moe_grouped_mm(x_MD, W, counts_E), order_M, w)
    with OpLog() as bwd:
        out.square().sum().backward()
    assert not (fwd.ops | bwd.ops) & FORBIDDEN, (fwd.ops | bwd.ops) & FORBIDDEN
    if grouped_mm_available(x_MD, W):
        assert "_grouped_mm" in fwd.ops and "_grouped_mm" in bwd.ops  # the grouped kernel in the backward too


def test_grouped_mm_under_autocast_runs_in_the_autocast_dtype():
    """torch._grouped_mm has no autocast rule: fp32 activations and weights are cast like an autocast linear's, so
    the bf16 kernel runs (its fp32 CUDA path loops over groups with host syncs); gradients reach fp32 in fp32."""
    counts = torch.tensor([2, 3, 0, 3])
    x = torch.randn(8, 16, requires_grad=True)
    W = torch.randn(4, 8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe_grouped_mm(x, W, counts)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, moe_grouped_mm(x.detach().bfloat16(), W.detach().bfloat16(), counts, impl="loop"))
    gx, gW = torch.autograd.grad(y.float().sum(), (x, W))
    assert gx.dtype == gW.dtype == torch.float32 and gW[2].abs().sum() == 0 and gW[3].abs().sum() > 0
    x64 = torch.randn(8, 16, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float64 references are left alone, as autocast does
        assert moe_grouped_mm(x64, W.detach().double(), counts).dtype == torch.float64


@pytest.mark.cuda
def test_latent_moe_bf16_step_has_no_host_sync_on_cuda():
    """fwd + bwd of the layer under bf16 autocast with CUDA's sync debug mode set to error (after a warm-up that
    runs the one-time grouped-matmul probe)."""
    cfg = cfg_with(moe_latent_size=64, moe_intermediate_size=64, d_model=128)
    moe = LatentMoE(cfg).cuda()
    x = torch.randn(2, 64, cfg.d_model, device="cuda", requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = moe(x)
        y.float().square().mean().backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_dispatch_rejects_bad_shapes():
    with pytest.raises(ValueError, match="moe_grouped_mm expects"):
        moe_grouped_mm(torch.randn(4, 8), torch.randn(2, 3, 5), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="moe_permute expects"):
        moe_permute(torch.randn(4, 8), torch.zeros(3, 2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match=r"x \[B, T, 64\]"):
        LatentMoE(DEBUG)(torch.randn(4, DEBUG.d_model))


# ---------------------------------------------------------------------------------------------------- training hooks


def test_gradients_reach_every_parameter():
    moe = LatentMoE(DEBUG)
    moe(torch.randn(2, 16, DEBUG.d_model)).pow(2).mean().backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, name
    assert moe.gate.e_score_correction_bias.grad is None


def test_parameter_names_and_shapes():
    E, D, L, F = DEBUG.num_experts, DEBUG.d_model, DEBUG.moe_latent_size, DEBUG.moe_intermediate_size
    shapes = {k: tuple(v.shape) for k, v in LatentMoE(DEBUG).state_dict().items()}
    assert shapes == {
        "gate.weight": (E, D), "gate.e_score_correction_bias": (E,),
        "fc1_latent_proj.weight": (L, D), "fc2_latent_proj.weight": (D, L),
        "experts.gate_up_proj": (E, 2 * F, L), "experts.down_proj": (E, L, F),
        "routed_expert_norm.weight": (L,),
        "shared_experts.gate_up_proj.weight": (2 * 2 * F, D), "shared_experts.down_proj.weight": (D, 2 * F),
    }
    bare = LatentMoE(cfg_with(num_shared_experts=0, latent_norm_pos="none"))
    assert bare.shared_experts is None and bare.routed_expert_norm is None


def test_record_router_stores_detached_stats():
    moe = LatentMoE(DEBUG)
    x = torch.randn(2, 8, DEBUG.d_model, requires_grad=True)
    moe(x)
    assert moe.last_scores is None and moe.last_topk_idx is None
    moe.record_router = True
    moe(x)
    assert moe.last_scores.shape == (16, DEBUG.num_experts) and moe.last_scores.dtype == torch.float32
    assert moe.last_topk_idx.shape == (16, DEBUG.num_experts_per_tok)
    assert not moe.last_scores.requires_grad
    s, idx, _ = moe.gate(x.reshape(-1, DEBUG.d_model))
    assert torch.equal(moe.last_scores, s.detach()) and torch.equal(moe.last_topk_idx, idx)


def test_capture_safe_gather_path_matches_loop():
    """The sync-free expert matmul used inside CUDA-graph capture (one gathered weight per row) == the loop,
    empty groups included."""
    from k3.kernels.moe.naive import _grouped_mm_gather

    counts = torch.tensor([3, 0, 5, 0, 4])
    x = torch.randn(12, 16, dtype=torch.float64)
    W = torch.randn(5, 8, 16, dtype=torch.float64)
    ref = torch.cat([x[a:b] @ W[e].t() for e, (a, b) in enumerate(zip([0, 3, 3, 8, 8], [3, 3, 8, 8, 12]))])
    torch.testing.assert_close(_grouped_mm_gather(x, W, counts), ref, atol=1e-12, rtol=1e-12)


def test_autocast_style_mixed_dtypes_cast_the_weights():
    """x in bf16 (an autocast linear's output) with fp32 expert weights: the weights are cast like autocast casts a
    linear's, the result equals the all-bf16 computation, and the gradient reaches the fp32 parameter in fp32."""
    counts = torch.tensor([2, 3, 1])
    x = torch.randn(6, 16).bfloat16()
    W = torch.randn(3, 8, 16, requires_grad=True)
    y = moe_grouped_mm(x, W, counts)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, moe_grouped_mm(x, W.detach().bfloat16(), counts, impl="loop"))
    (gW,) = torch.autograd.grad(y.float().sum(), W)
    assert gW.dtype == torch.float32 and gW.abs().sum() > 0
