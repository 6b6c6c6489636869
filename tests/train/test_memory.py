"""Memory switches for long sequences change no number: activation checkpointing (train.activation_checkpointing:
mla, all) and the chunked loss (train.loss_chunk_tokens) give the gradients of the plain step."""

import pytest
import torch
import torch.nn.functional as F

import k3.kernels.moe.naive as moe_naive
from k3.cli.config import resolve_config
from k3.model.transformer import build_model
from k3.train.loop import chunked_cross_entropy, lm_losses


def _grads(model, tokens, *, mode="none", chunk=0):
    model.zero_grad(set_to_none=True)
    model.model.activation_checkpointing = mode
    losses = lm_losses(model, tokens, None, chunk_tokens=chunk)
    (losses["ce"] + 0.3 * losses["mtp_ce"]).backward()
    model.model.activation_checkpointing = "none"
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("residual", ["attnres", "preln"])
def test_activation_checkpointing_gives_the_unchecked_gradients(residual):
    cfg = resolve_config("pretrain", preset="debug", sets=[f"model.residual={residual}"]).model
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # non-zero pseudo-queries, so the AttnRes path is exercised fully
        for n, p in model.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 97), generator=torch.Generator().manual_seed(0))
    moe_naive._PROBED.clear()  # the grouped-matmul probe's first run must not fall inside a checkpointed region
    _grads(model, tokens, mode="all")
    ref_losses, ref = _grads(model, tokens)
    for mode in ("mla", "all"):
        losses, got = _grads(model, tokens, mode=mode)
        assert losses["ce"].item() == ref_losses["ce"].item()
        assert got.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-7, msg=f"{mode}: {n}")


def test_activation_checkpointing_recomputes_only_what_it_names():
    cfg = resolve_config("pretrain", preset="debug").model
    model = build_model(cfg, seed=0)
    calls = {"kda": 0, "mla": 0}
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda m, i, t=layer.layer_type: calls.__setitem__(t, calls[t] + 1))
    tokens = torch.randint(0, cfg.vocab_size, (1, 33))
    n_kda, n_mla = cfg.layer_types.count("kda"), cfg.layer_types.count("mla")
    for mode, extra_kda, extra_mla in (("none", 0, 0), ("mla", 0, n_mla), ("all", n_kda, n_mla)):
        calls.update(kda=0, mla=0)
        _grads(model, tokens, mode=mode)
        assert calls == {"kda": n_kda + extra_kda, "mla": n_mla + extra_mla}, mode
    model.model.activation_checkpointing = "some"
    with pytest.raises(ValueError, match="none, mla or all"):
        model(tokens)


def test_chunked_loss_equals_the_whole_loss_and_its_gradients():
    cfg = resolve_config("pretrain", preset="debug").model
    model = build_model(cfg, seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 81))
    mask = torch.rand(2, 80) > 0.2
    model.zero_grad()
    whole = lm_losses(model, tokens, mask)
    (whole["ce"] + whole["mtp_ce"]).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for chunk in (7, 64, 1000):
        model.zero_grad()
        part = lm_losses(model, tokens, mask, chunk_tokens=chunk)
        torch.testing.assert_close(part["ce"], whole["ce"], rtol=1e-6, atol=0)
        torch.testing.assert_close(part["mtp_ce"], whole["mtp_ce"], rtol=1e-6, atol=0)
        (part["ce"] + part["mtp_ce"]).backward()
        for n, p in model.named_parameters():
            if n in ref:
                torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-7, msg=f"chunk {chunk}: {n}")


def test_chunked_cross_entropy_against_float64():
    h = torch.randn(3, 10, 8, dtype=torch.float64)
    w = torch.randn(20, 8, dtype=torch.float64)
    t = torch.randint(0, 20, (3, 10))
    t[0, :4] = -100
    got = chunked_cross_entropy(lambda x: x @ w.T, h, t, 4)
    keep = t.reshape(-1) != -100
    logp = torch.log_softmax(h.reshape(-1, 8) @ w.T, dim=-1)
    ref = -logp[keep, t.reshape(-1)[keep]].mean()
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)
    assert F.cross_entropy((h @ w.T).reshape(-1, 20), t.reshape(-1)).item() == pytest.approx(ref.item(), rel=1e-12)
