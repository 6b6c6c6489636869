"""A k3-debug K3Model's forward and backward with the fused Block AttnRes mixture (k3kernels/attnres/triton.py, Triton's
interpreter on a CPU) against the same model on the torch backend (the list-form twin): logits and every parameter's
gradient, with pseudo-queries far from their zero init so every mixture is non-uniform.

Two runs: the triton backend with only the mixture's kernel registered (everything else on its PyTorch twin), which
isolates the mixture: fp32 rounding, amplified through four layers to ~1e-5 in the smallest gradients (A_log), passes
1e-4 (the rms' gradient left out gives 0.7); and the whole triton backend (the KDA chunk kernels' tf32x3 dots, the
fused C2-GLU, ...) on one 12-token sequence, within 1e-3 (measured 7e-5).
"""

import importlib
import importlib.util
import os
from unittest import mock

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"

with mock.patch.dict(os.environ, {} if CUDA else {"TRITON_INTERPRET": "1"}):  # triton.jit reads it per kernel
    ar_triton = importlib.import_module("k3.kernels.attnres.triton")

from k3.cli.config import load_model_config
from k3.kernels import dispatch
from k3.model.transformer import build_model

pytestmark = pytest.mark.usefixtures("triton_cpu")  # tests/kernels/conftest.py


@pytest.fixture(scope="module")
def model_and_tokens():
    model = build_model(load_model_config("k3-debug"), seed=0)
    with torch.no_grad():  # on the CPU: a CPU generator, the same values on either device
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    model = model.to(DEV)
    tokens = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    return model, tokens.to(DEV)


def step(model, tokens):
    """Logits and every parameter's gradient of a loss that reaches every mixture."""
    model.zero_grad(set_to_none=True)
    out = model(tokens, mtp_tokens_BT=tokens)
    (out.logits.float().pow(2).mean() + out.mtp_logits.float().pow(2).mean()).backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(ref, got, ratio):
    (logits_ref, grads_ref), (logits, grads) = ref, got
    assert ((logits - logits_ref).norm() / logits_ref.norm()).item() < ratio
    assert grads.keys() == grads_ref.keys()
    rel = {n: ((grads[n] - g).norm() / (g.norm() + 1e-12)).item() for n, g in grads_ref.items()}
    worst = max(rel, key=rel.get)
    assert rel[worst] < ratio, (worst, rel[worst])


def test_model_with_the_fused_mixture_equals_the_torch_backend(model_and_tokens, kernel_env, monkeypatch):
    model, tokens = model_and_tokens
    kernel_env(K3_KERNELS="torch")
    ref = step(model, tokens)
    calls = []
    real = ar_triton.attn_res_mix_triton
    monkeypatch.setattr(ar_triton, "attn_res_mix_triton", lambda *a: calls.append(len(a[0])) or real(*a))
    monkeypatch.setattr(dispatch, "TRITON_OPS", {"attn_res_mix": dispatch.TRITON_OPS["attn_res_mix"]})
    kernel_env(K3_KERNELS="triton")
    got = step(model, tokens)
    # 4 layers of block size 2: two mixtures a layer but layer 0's mixer, then the output's over 3 sources
    assert calls == [2, 2, 2, 2, 3, 3, 3, 3]
    compare(ref, got, 1e-4)


def test_model_on_the_whole_triton_backend(model_and_tokens, kernel_env):
    model, tokens = model_and_tokens
    tokens = tokens[:1, :12]  # every kernel under the interpreter: one short sequence
    kernel_env(K3_KERNELS="torch")
    ref = step(model, tokens)
    kernel_env(K3_KERNELS="triton")
    compare(ref, step(model, tokens), 1e-3)
