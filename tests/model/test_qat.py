"""Quantization-aware K3Model (k3.model.quant): the module selections, fake quantization as a property of the
modules (state dict and parameters unchanged, gradients reaching the weights), the conversion giving the fake-quant
model's logits, loading of every selection, and the errors a user can act on; learned scales (LSQ) as parameters of
the modules, and the conversion on them."""

import pytest
import torch

from k3.kernels.quant import fake_quant_fp8_per_token, fake_quant_weight, fake_quant_weight_lsq, int4_group_scales
from k3.model.checkpoint import CheckpointError, instantiate
from k3.model.config import ModelConfig
from k3.model.moe import GroupedExperts
from k3.model.quant import (
    FakeQuantLinear,
    QuantGroupedExperts,
    QuantLinear,
    apply_quantization,
    enable_fake_quant,
    make_quantization_config,
    pop_learned_scales,
    quant_targets,
    quantize_state_dict,
)
from k3.model.transformer import K3Model, build_model, count_parameters

CFG = ModelConfig()  # k3-debug: 4 layers (layer 0 dense), 3 MoE layers with 2 shared experts, MTP, MLA at layer 4
TOKENS = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
CASES = [("routed_experts", "w4a8"), ("routed_experts", "w8a16"), ("experts", "w4a16"), ("all_linear", "w4a8"),
         ("all_linear", "w4a16")]


def _sd(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_selections():
    model = build_model(CFG, seed=0)
    names = {kind: [n for n, _, k in quant_targets(model, ["routed_experts", "shared_experts", "linear"])
                    if k == kind] for kind in ("routed_experts", "shared_experts", "linear")}
    assert names["routed_experts"] == [f"model.layers.{i}.mlp.experts" for i in (1, 2, 3)]
    assert names["shared_experts"] == [f"model.layers.{i}.mlp.shared_experts.{p}" for i in (1, 2, 3)
                                       for p in ("gate_up_proj", "down_proj")]
    lin = names["linear"]
    assert "lm_head" in lin and "model.layers.0.mlp.gate_up_proj" in lin and "model.layers.1.self_attn.q_proj" in lin
    assert "model.layers.1.mlp.fc1_latent_proj" in lin and any(n.startswith("mtp.") for n in lin)
    assert not any(n.endswith("kv_b_proj") for n in lin)  # the absorbed MLA decode reads it as a matrix
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert len(lin) + len(names["shared_experts"]) == n_linear - 2  # all but the two kv_b_proj (main + MTP)


@pytest.mark.parametrize(("modules", "fmt"), CASES)
def test_fake_quant_keeps_the_state_dict_and_trains_the_same_parameters(modules, fmt):
    model = build_model(CFG, seed=0)
    before, params = _sd(model), dict(model.named_parameters())
    enable_fake_quant(model, make_quantization_config(fmt, 16, modules, "qat"))
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    n_fq = sum(isinstance(m, FakeQuantLinear) for m in model.modules())
    assert n_fq == {"routed_experts": 0, "experts": 6}.get(modules, n_fq) and (n_fq > 6) == (modules == "all_linear")
    model(TOKENS).logits.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if ".mlp.experts." in n)


def test_fake_quant_forward_is_the_format_on_the_modules_own_math():
    """An all_linear fake-quant linear computes F.linear(A(x), Q(W)); routed experts quantize both matmuls."""
    model = build_model(CFG, seed=0)
    enable_fake_quant(model, make_quantization_config("w4a8", 16, "all_linear", "qat"))
    head = model.lm_head
    x = torch.randn(3, CFG.d_model)
    want = fake_quant_fp8_per_token(x) @ fake_quant_weight(head.weight.detach(), "w4a8", 16).T
    assert torch.equal(head(x), want)
    ex = model.model.layers[1].mlp.experts
    assert ex.fake_quant is not None and type(ex) is GroupedExperts


def test_learned_scales_are_parameters_of_the_modules():
    model = build_model(CFG, seed=0)
    before = _sd(model)
    qc = make_quantization_config("w4a8", 16, "all_linear", "qat")
    with torch.no_grad():
        ref = enable_fake_quant(build_model(CFG, seed=0), qc).eval()(TOKENS).logits
    head_init = int4_group_scales(model.lm_head.weight, 16) * 0.75
    enable_fake_quant(model, qc, scales="learned", init_scales={"lm_head.weight": head_init}, scale_lr=0.1)
    weights = {n: w for n, w in before.items() if n + "_scales" in dict(model.named_parameters())}
    scales = {n: p for n, p in model.named_parameters() if n.endswith("_scales")}
    assert len(weights) == len(scales) > 6 and "model.layers.1.mlp.experts.gate_up_proj" in weights
    for n, w in weights.items():
        s = scales[n + "_scales"]
        assert s.dtype == torch.float32 and s.shape == (*w.shape[:-1], w.shape[-1] // 16)
        assert torch.equal(s.detach(), head_init if n == "lm_head.weight" else int4_group_scales(w, 16))
    assert model.lm_head.fake_quant.learned and model.lm_head.fake_quant.scale_lr == 0.1
    model.lm_head.weight_scales.data.copy_(int4_group_scales(model.lm_head.weight, 16))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, ref)  # on the absmax scales: the absmax fake quantizer's bits
    head = model.lm_head
    x = torch.randn(3, CFG.d_model)
    want = fake_quant_fp8_per_token(x) @ fake_quant_weight_lsq(head.weight, head.weight_scales).T
    assert torch.equal(head(x), want)
    model.train()
    model(TOKENS).logits.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in scales.items() if ".mlp.experts." in n)
    assert count_parameters(model) == count_parameters(build_model(CFG, seed=0))  # scales are not weights
    rest, popped = pop_learned_scales(model.state_dict())
    assert list(rest) == list(before) and set(popped) == set(weights)
    # w8a16 is per channel: it keeps absmax scales and registers nothing
    m8 = enable_fake_quant(build_model(CFG, seed=0), make_quantization_config("w8a16", None, "experts", "qat"),
                           scales="learned")
    assert not any(n.endswith("_scales") for n, _ in m8.named_parameters())


@pytest.mark.parametrize(("modules", "fmt", "scales"), [(*c, "absmax") for c in CASES]
                         + [("all_linear", "w4a8", "learned"), ("experts", "w4a16", "learned")])
def test_converted_release_computes_the_fake_quant_logits(modules, fmt, scales):
    model = build_model(CFG, seed=1)
    with torch.no_grad():  # widen the weights a little so the int4 grid is coarse relative to them
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    qc = make_quantization_config(fmt, 16, modules, "qat")
    enable_fake_quant(model, qc, scales=scales)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # learned: scales away from absmax (clipping some groups, widening others)
        for n, p in model.named_parameters():
            if n.endswith("_scales"):
                p.mul_(0.5 + 0.7 * torch.rand(p.shape, generator=g))
    model.eval()
    with torch.no_grad():
        fq = model(TOKENS).logits
    sd, learned = pop_learned_scales(_sd(model))
    assert bool(learned) == (scales == "learned")
    qsd, qc2 = quantize_state_dict(sd, CFG, fmt, 16, modules, "qat", scales=learned or None)
    for n, s in learned.items():
        assert torch.equal(qsd[n + ".scales"], s)  # the release stores the trained scales, fp32 [.., N, K/g]
    assert qc2 == qc
    q = instantiate(lambda: apply_quantization(K3Model(CFG), qc2), qsd).eval()
    kinds = {QuantGroupedExperts: 3, QuantLinear: {"routed_experts": 0, "experts": 6}.get(modules)}
    assert sum(type(m) is QuantGroupedExperts for m in q.modules()) == kinds[QuantGroupedExperts]
    if kinds[QuantLinear] is not None:
        assert sum(type(m) is QuantLinear for m in q.modules()) == kinds[QuantLinear]
    with torch.no_grad():
        out = q(TOKENS).logits
    assert torch.equal(out, fq)  # the same codes, scales and fp32 products: bit for bit on the CPU
    base = build_model(CFG, seed=1)
    with torch.no_grad():
        for n, p in base.named_parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
        assert not torch.equal(base.eval()(TOKENS).logits, out)  # the quantization is not a no-op
    assert count_parameters(q) == count_parameters(base)


def test_errors_name_the_tensor_and_the_fix():
    model = build_model(CFG, seed=0)
    with pytest.raises(CheckpointError, match=r"group size 64 does not divide the in-features 32 of "
                       r"model.layers.1.mlp.experts.gate_up_proj; group sizes that divide every selected tensor: "
                       r"\[16, 32\]"):
        enable_fake_quant(model, make_quantization_config("w4a8", 64, "routed_experts", "qat"))
    wide = ModelConfig(moe_latent_size=64, moe_intermediate_size=64)  # experts take 64; KDA's f_b_proj takes 32
    quantize_state_dict(_sd(build_model(wide, seed=0)), wide, "w4a16", 64, "experts")
    with pytest.raises(CheckpointError, match=r"group size 64 does not divide the in-features 32 of "
                       r"model.layers.0.self_attn.f_b_proj.weight; group sizes that divide every selected tensor: "
                       r"\[16, 32\]"):
        quantize_state_dict(_sd(build_model(wide, seed=0)), wide, "w4a16", 64, "all_linear")
    with pytest.raises(CheckpointError, match="format w8a16 does not support the linear modules"):
        make_quantization_config("w8a16", None, "all_linear")
    with pytest.raises(CheckpointError, match="modules 'everything' is not a module selection"):
        make_quantization_config("w4a8", 32, "everything")
    tied = ModelConfig(tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match="ties to the embedding table; use modules experts"):
        enable_fake_quant(build_model(tied, seed=0), make_quantization_config("w4a8", 16, "all_linear", "qat"))
    dense = ModelConfig(first_k_dense=4)
    with pytest.raises(CheckpointError, match="no routed experts"):
        enable_fake_quant(build_model(dense, seed=0), make_quantization_config("w4a8", 16))
