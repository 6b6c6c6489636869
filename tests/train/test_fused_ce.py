"""lm_losses with the fused head + cross-entropy gives the losses and every parameter gradient of the whole-logits
form (the model's logits, then F.cross_entropy in fp32), for CE and MTP CE; a head that is not a plain nn.Linear
(QAT's fake-quantized one) keeps its own forward; the model's head inputs are what its head reads."""

import pytest
import torch
import torch.nn.functional as F

from k3.cli.config import resolve_config
from k3.kernels.testing import assert_close
from k3.model.quant import enable_fake_quant, make_quantization_config
from k3.model.transformer import build_model
from k3.train.loop import lm_losses


@pytest.fixture(scope="module")
def cfg():
    return resolve_config("pretrain", preset="debug").model


def whole_logits_losses(model, tokens, mask, with_mtp=True):
    """The losses over the whole [B, T, V] logits, as the train loop computed them before the fused op."""
    targets = tokens[:, 1:].clone()
    if mask is not None:
        targets[~mask] = -100
    out = model(tokens[:, :-1], mtp_tokens_BT=tokens[:, 1:] if with_mtp else None)
    V = out.logits.shape[-1]
    res = {"ce": F.cross_entropy(out.logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=-100)}
    if with_mtp:
        mtp_t = torch.cat([targets[:, 1:], torch.full_like(targets[:, :1], -100)], dim=1)
        res["mtp_ce"] = F.cross_entropy(out.mtp_logits.float().reshape(-1, V), mtp_t.reshape(-1), ignore_index=-100)
    return res


def grads(model, fn):
    model.zero_grad(set_to_none=True)
    losses = fn()
    sum(w * losses[k] for k, w in (("ce", 1.0), ("mtp_ce", 0.3)) if k in losses).backward()
    return {k: v.detach() for k, v in losses.items()}, {n: p.grad.clone() for n, p in model.named_parameters()
                                                         if p.grad is not None}


@pytest.mark.parametrize("chunk,with_mtp", [(0, True), (7, True), (0, False)], ids=["default", "chunk7", "no-mtp"])
def test_fused_losses_and_gradients_equal_the_whole_logits(cfg, chunk, with_mtp):
    model = build_model(cfg, seed=3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 41), generator=g)
    mask = torch.rand(2, 40, generator=g) > 0.25
    assert model.plain_head_weight() is model.lm_head.weight
    ref_l, ref_g = grads(model, lambda: whole_logits_losses(model, tokens, mask, with_mtp))
    got_l, got_g = grads(model, lambda: lm_losses(model, tokens, mask, with_mtp=with_mtp, chunk_tokens=chunk))
    assert got_l.keys() == ref_l.keys() == ({"ce", "mtp_ce"} if with_mtp else {"ce"})
    for k in ref_l:
        torch.testing.assert_close(got_l[k], ref_l[k], rtol=1e-5, atol=0)
    assert got_g.keys() == ref_g.keys()
    assert with_mtp or not any(n.startswith("mtp.") for n in got_g)
    for n in ref_g:
        assert_close(n, ref_g[n], got_g[n], 1e-5)


def test_evaluation_builds_no_graph(cfg):
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    with torch.no_grad():
        got = lm_losses(model, tokens, None, with_mtp=False)["ce"]
        ref = whole_logits_losses(model, tokens, None, with_mtp=False)["ce"]
    assert got.grad_fn is None
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("chunk", [0, 9])
def test_a_fake_quantized_head_runs_its_own_forward(cfg, chunk):
    model = build_model(cfg, seed=1)
    enable_fake_quant(model, make_quantization_config("w4a16", 32, "all_linear", "qat"))
    assert model.plain_head_weight() is None
    calls = []
    model.lm_head.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    tokens = torch.randint(0, cfg.vocab_size, (2, 25))
    ref_l, ref_g = grads(model, lambda: whole_logits_losses(model, tokens, None))
    calls.clear()
    got_l, got_g = grads(model, lambda: lm_losses(model, tokens, None, chunk_tokens=chunk))
    assert calls  # the quantized head computed the logits, not the fused op on its raw weight
    for k in ref_l:
        torch.testing.assert_close(got_l[k], ref_l[k], rtol=1e-6, atol=0)
    for n in ref_g:
        assert_close(n, ref_g[n], got_g[n], 1e-5)


def test_head_inputs_are_what_the_head_reads(cfg):
    model = build_model(cfg, seed=2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 13))
    nxt = torch.randint(0, cfg.vocab_size, (2, 13))
    with torch.no_grad():
        full = model(tokens, mtp_tokens_BT=nxt)
        bare = model(tokens, mtp_tokens_BT=nxt, head=False)
    assert bare.logits is None and bare.mtp_logits is None
    torch.testing.assert_close(bare.hidden, full.hidden, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head(bare.head_input), full.logits, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head(bare.mtp_head_input), full.mtp_logits, rtol=0, atol=0)
