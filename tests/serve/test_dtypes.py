"""Serving checkpoints exported in bf16 (serving.md: `k3 serve` takes bf16 checkpoints): load, dtype policy, output.

- a bf16 release loads with dtype "auto" on the CPU as float32 (the CPU policy) holding exactly the bf16 values, and
  the engine's greedy tokens equal the argmax of a plain full forward of that model (an independent path);
- dtype "bfloat16" runs the engine in bf16 end to end (float32 kept for the FP32_TENSORS such as the router bias);
  every greedy token it picks is within 0.25 nats of the float32 model's best next token at that point.
"""

from __future__ import annotations

import json

import torch

from k3.model.checkpoint import keeps_fp32, load_model, save_release
from k3.model.tokenizer import K3Tokenizer
from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.request import SamplingParams
from k3.serve.server import load_state, make_state

PROMPT = "def load(path):\n    "


def _bf16_release(model, ckpt, out):
    return save_release(out, {k: v.detach() for k, v in model.state_dict().items()}, model.config,
                        tokenizer_dir=ckpt, dtype=torch.bfloat16)


def _greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    events = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
    return [t for ev in events for t in ev.token_ids]


def test_bf16_checkpoint_auto_on_cpu_is_fp32_and_exact(model_tok, ckpt, tmp_path):
    model, tok = model_tok
    rel = _bf16_release(model, ckpt, tmp_path / "bf16")
    assert json.loads((rel / "config.json").read_text())["torch_dtype"] == "bfloat16"
    cfg = ServeConfig(ckpt=str(rel), device="cpu", dtype="auto", max_model_len=256, max_num_seqs=2, warmup=False)
    state = make_state(cfg)
    load_state(cfg, state)
    try:
        served = state.engine.model
        for name, p in served.state_dict().items():
            assert p.dtype == torch.float32, name
            src = model.state_dict()[name]
            want = src if keeps_fp32(name) else src.to(torch.bfloat16).float()
            assert torch.equal(p, want), f"{name} is not the bf16 value of the source weight"
        prompt = tok.encode(PROMPT)
        out = _greedy(state.engine, prompt, 8)
        ids = torch.tensor([prompt + out])
        with torch.no_grad():
            logits = served(ids).logits[0]  # [T, V]
        assert out == logits[len(prompt) - 1:-1].argmax(-1).tolist()
    finally:
        state.engine.stop()


def test_bf16_compute_on_cpu_tracks_fp32(model_tok, ckpt, tmp_path):
    model, _ = model_tok
    rel = _bf16_release(model, ckpt, tmp_path / "bf16")
    bf_model, _ = load_model(rel, dtype="bfloat16")
    for name, p in bf_model.state_dict().items():
        assert p.dtype == (torch.float32 if keeps_fp32(name) else torch.bfloat16), name
    tok = K3Tokenizer.from_file(rel)
    cfg = ServeConfig(ckpt=str(rel), device="cpu", dtype="bfloat16", max_model_len=256, max_num_seqs=2)
    engine = Engine(bf_model, tok, cfg)
    prompt = tok.encode(PROMPT)
    out = _greedy(engine, prompt, 12)
    assert len(out) == 12
    f32_model, _ = load_model(rel, dtype="float32")
    with torch.no_grad():
        logits = f32_model(torch.tensor([prompt + out])).logits[0]  # [T, V]
    lp = torch.log_softmax(logits[len(prompt) - 1:-1].float(), -1)  # [12, V]
    gap = lp.max(-1).values - lp.gather(1, torch.tensor(out)[:, None])[:, 0]
    assert gap.max().item() < 0.25, f"bf16 picked tokens {gap.tolist()} nats below the fp32 best"


def test_serve_dtype_policy(tmp_path):
    """`k3 serve --dtype auto`: float32 on the CPU, bfloat16 on a GPU (serving.md 2.5: bf16 by default) unless the
    checkpoint is float16; an explicit dtype is kept. Read from config.json's torch_dtype."""
    from k3.serve.config import serve_dtype

    for saved, gpu in (("float32", "bfloat16"), ("bfloat16", "bfloat16"), ("float16", "float16"), (None, "bfloat16")):
        d = tmp_path / str(saved)
        d.mkdir()
        (d / "config.json").write_text(json.dumps({} if saved is None else {"torch_dtype": saved}))
        assert serve_dtype("auto", "cuda", str(d)) == gpu, saved
        assert serve_dtype("auto", "cpu", str(d)) == "float32"
        assert serve_dtype("float32", "cuda", str(d)) == "float32"
    assert serve_dtype("auto", "cuda", str(tmp_path / "missing")) == "bfloat16"  # load_model reports it
