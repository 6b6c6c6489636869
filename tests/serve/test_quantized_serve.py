"""Serving a quantized release (serving.md 2.5 "Weights"): the Engine on a W4A8 checkpoint decodes exactly like the
Engine on the bf16/fp32 model holding the dequantized expert weights (with the same FP8 activation fake-quant), and
`k3 serve` loads the quantized directory and answers a completion through the openai client."""

import types

import pytest
import torch

from k3.kernels.moe import moe_grouped_mm
from k3.kernels.quant import dequantize_weight, fake_quant_fp8_per_token
from k3.model.checkpoint import load_model
from k3.model.layers import glu_activation
from k3.model.moe import GroupedExperts
from k3.model.quant import QuantGroupedExperts
from k3.model.tokenizer import K3Tokenizer
from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.request import SamplingParams
from k3.train.quantize import quantize_release


@pytest.fixture(scope="module")
def qckpt(ckpt, tmp_path_factory):
    """The session's trained k3-debug release (tests/serve/conftest.py), RTN-quantized to w4a8."""
    return quantize_release(ckpt, tmp_path_factory.mktemp("q") / "final-q", fmt="w4a8", group_size=32)


def _fake_quant_forward(self, x_ML, counts_E):
    gate, up = moe_grouped_mm(fake_quant_fp8_per_token(x_ML), self.gate_up_proj, counts_E).split(self.d_ff, -1)
    h = glu_activation(gate, up, self.act, self.beta1, self.beta2)
    return moe_grouped_mm(fake_quant_fp8_per_token(h), self.down_proj, counts_E)


def _dequantized_reference(ckpt, qmodel):
    """The unquantized model with each GroupedExperts' weights set to the quantized model's dequantized ones and
    the per-token FP8 fake-quant in front of both expert matmuls (what W4A8 computes, in plain modules)."""
    ref, _ = load_model(ckpt)
    qmods = {n: m for n, m in qmodel.named_modules() if isinstance(m, QuantGroupedExperts)}
    n_swapped = 0
    for name, mod in ref.named_modules():
        if isinstance(mod, GroupedExperts):
            q = qmods[name]
            for w in ("gate_up_proj", "down_proj"):
                getattr(mod, w).data = dequantize_weight(getattr(q, w), getattr(q, w + "_scales"), "w4a8")
            mod.forward = types.MethodType(_fake_quant_forward, mod)
            n_swapped += 1
    assert n_swapped == len(qmods) > 0
    return ref


def _greedy(model, tok, prompts, max_tokens=12):
    eng = Engine(model, tok, ServeConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                                         warmup=False))
    out = {i: [] for i in range(len(prompts))}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.submit(p, params, lambda ev, i=i: out[i].extend(ev.token_ids))
    while eng.has_work():
        eng.step()
    return [out[i] for i in range(len(prompts))]


def test_engine_greedy_equals_dequantized_reference(ckpt, qckpt):
    qmodel, _ = load_model(qckpt)
    tok = K3Tokenizer.from_file(qckpt)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (1, 9, 40)]
    got = _greedy(qmodel, tok, prompts)
    assert all(len(t) == 12 for t in got)
    assert got == _greedy(_dequantized_reference(ckpt, qmodel), tok, prompts)


def test_k3_serve_loads_the_quantized_checkpoint(qckpt, serve_process):
    from openai import OpenAI

    with serve_process(qckpt, "--max-model-len", "256", "--max-batch", "2") as run:
        assert run.statuses and run.statuses[-1] == 200, run.log or run.statuses[-5:]
        client = OpenAI(base_url=run.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model=client.models.list().data[0].id, prompt="def", max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4 and isinstance(r.choices[0].text, str)
    log = run.log
    assert "k3 serve: ready in" in log, log


@pytest.fixture(scope="module")
def qckpt_all(ckpt, tmp_path_factory):
    """The same release with every linear quantized (all_linear, w4a8: int4 weights, FP8 activations)."""
    return quantize_release(ckpt, tmp_path_factory.mktemp("qa") / "final-qa", fmt="w4a8", group_size=32,
                            modules="all_linear")


def test_engine_on_all_linear_equals_the_fake_quant_model(ckpt, qckpt_all):
    """The engine (paged caches, absorbed MLA decode, QuantLinear everywhere but kv_b_proj) decodes the quantized
    release exactly as it decodes the unquantized model made quantization-aware with the same config."""
    from k3.model.checkpoint import read_quantization_config
    from k3.model.quant import QuantLinear, enable_fake_quant

    qmodel, _ = load_model(qckpt_all)
    assert sum(isinstance(m, QuantLinear) for m in qmodel.modules()) > 10
    ref, _ = load_model(ckpt)
    enable_fake_quant(ref, read_quantization_config(qckpt_all))
    tok = K3Tokenizer.from_file(qckpt_all)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (3, 30)]
    assert _greedy(qmodel, tok, prompts) == _greedy(ref, tok, prompts)


def test_k3_serve_loads_an_all_linear_checkpoint(qckpt_all, serve_process):
    with serve_process(qckpt_all, "--max-model-len", "256", "--max-batch", "2") as run:
        assert run.statuses and run.statuses[-1] == 200, run.log or run.statuses[-5:]
    assert "k3 serve: ready in" in run.log, run.log
