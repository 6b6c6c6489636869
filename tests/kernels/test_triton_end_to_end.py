"""The whole serving path on the "triton" backend (Triton's interpreter on a CPU, the GPU otherwise) against the
"torch" backend: one k3-debug model (random weights) served by the engine, prompt prefill (chunk_kda), decode
(fused_recurrent_kda on the state pool, paged_mla_decode, the fused C2-GLU); greedy tokens identical and every
step's logits within 1e-4 (fp32)."""

import dataclasses
import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

from k3.cli.config import load_model_config
from k3.model.tokenizer import train_bpe
from k3.model.transformer import build_model
from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.request import SamplingParams

CUDA = torch.cuda.is_available()


def _run(backend, monkeypatch, model, tok, kernel_env):
    kernel_env(K3_KERNELS=backend)
    if backend == "triton" and not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = ServeConfig(device=model.lm_head.weight.device.type, max_num_seqs=2, max_model_len=256,
                      max_num_batched_tokens=128, enable_prefix_caching=False, warmup=False, cuda_graphs=False)
    eng = Engine(model, tok, cfg)
    logits = []
    orig = eng.runner.step

    def spy(seqs):
        out = orig(seqs)
        logits.extend(x for x in out.logits if x is not None)
        return out

    eng.runner.step = spy
    prompt = [(7 * i) % 200 + 4 for i in range(70)]  # 70 tokens: a full 64-token chunk and a partial one
    events = eng.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    return [t for ev in events for t in ev.token_ids], logits


def test_serving_on_triton_backend_equals_torch_backend(monkeypatch, kernel_env):
    import k3.kernels.glu.triton as glu_t
    import k3.kernels.kda.chunk as chunk_t
    import k3.kernels.kda.triton.recurrent as rec_t
    import k3.kernels.mla.triton_decode as mla_t

    calls = {}

    def counting(fn, name):
        def counted(*a, **kw):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **kw)
        return counted

    for mod, name in ((chunk_t, "chunk_kda_triton"), (rec_t, "fused_recurrent_kda_triton"),
                      (mla_t, "paged_mla_decode_triton"), (glu_t, "c2_glu_packed_dispatch")):
        monkeypatch.setattr(mod, name, counting(getattr(mod, name), name))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = train_bpe(["def f(x):\n    return x + 1\n" * 20], vocab_size=300)
        cfg = dataclasses.replace(load_model_config("k3-debug"), vocab_size=tok.vocab_size)
        model = build_model(cfg, seed=0).to("cuda" if CUDA else "cpu").eval()
        ref_tokens, ref_logits = _run("torch", monkeypatch, model, tok, kernel_env)
        tri_tokens, tri_logits = _run("triton", monkeypatch, model, tok, kernel_env)
    finally:
        torch.set_num_threads(n)
    assert set(calls) == {"chunk_kda_triton", "fused_recurrent_kda_triton", "paged_mla_decode_triton",
                          "c2_glu_packed_dispatch"}, calls  # every Triton entry point served part of the request
    assert tri_tokens == ref_tokens and len(tri_logits) == len(ref_logits) >= 4
    for a, b in zip(ref_logits, tri_logits):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
