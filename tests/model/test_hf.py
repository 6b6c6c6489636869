"""Hugging Face transformers interop (docs/hf.md): k3.model.hf's Auto classes load a k3 release as k3 writes it, with
k3's parameter names, k3's logits and `k3 generate`'s greedy tokens; `k3 export-hf` writes a directory that loads with
trust_remote_code=True in a Python that cannot import k3; quantized releases are refused with the fix."""

import ast
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from typer.testing import CliRunner

from k3.cli.main import app
from k3.model.checkpoint import CheckpointError, load_model, load_release, read_release_config
from k3.model.config import ConfigError, ModelConfig
from k3.model.hf import CACHE_KWARG, K3Cache, K3Config, K3ForCausalLM
from k3.model.hf_export import AUTO_MAP, ENTRY_MODULE, export_hf
from k3.model.tokenizer import K3Tokenizer, train_bpe
from k3.model.transformer import build_model
from k3.serve.generate import generate_tokens

CFG = ModelConfig()  # k3-debug: 3 KDA layers and one MLA layer, MoE, AttnRes, MTP
CORPUS = ["def main(x):\n    return x + 1\n", "the quick brown fox jumps over the lazy dog. ",
          "import torch\nprint(torch.ones(2))\n", "for i in range(10):\n    total += i * i\n"] * 20
PROMPT = "def main(x):\n    return"
runner = CliRunner()


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """A random-init k3-debug release in fp32 with a BPE tokenizer, written by k3's own save_release."""
    root = tmp_path_factory.mktemp("hf")
    train_bpe(CORPUS, vocab_size=CFG.vocab_size).save(root / "tok")
    model = build_model(CFG, seed=3)
    return save_release_fp32(root / "final", model, root / "tok")


def save_release_fp32(out: Path, model, tok_dir: Path) -> Path:
    from k3.model.checkpoint import save_release

    return save_release(out, model.state_dict(), CFG, tokenizer_dir=tok_dir, dtype="float32",
                        max_position_embeddings=256)


@pytest.fixture(scope="module")
def k3_model(release):
    return load_model(release)[0]


@pytest.fixture(scope="module")
def hf_model(release):
    return AutoModelForCausalLM.from_pretrained(release)


def prompt_ids(release) -> list[int]:
    return K3Tokenizer.from_file(release).encode(PROMPT, add_bos=True)


def assert_rel_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * want.double().abs().max().item(), f"max abs error {err} vs scale {want.abs().max().item()}"


def test_import_registers_the_auto_classes():
    assert CONFIG_MAPPING["k3"] is K3Config
    assert MODEL_FOR_CAUSAL_LM_MAPPING[K3Config] is K3ForCausalLM


def test_config_is_k3s_model_config(release):
    cfg = AutoConfig.from_pretrained(release)
    assert isinstance(cfg, K3Config) and cfg.model_type == "k3"
    assert cfg.to_model_config() == read_release_config(release)
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (CFG.d_model, CFG.n_layers)
    assert K3Config.from_model_config(CFG).to_model_config() == CFG
    with pytest.raises(ConfigError, match="d_model"):  # k3's strict parsing, not a second list of fields
        K3Config(d_model="wide")
    with pytest.raises(ConfigError, match="mla_position"):
        K3Config(mla_position="alibi")


def test_auto_classes_load_the_release_with_k3_names(release, hf_model):
    assert type(hf_model) is K3ForCausalLM and not hf_model.training
    _, sd = load_release(release)
    got = hf_model.state_dict()
    assert sorted(got) == sorted(sd)
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    assert hf_model.config.max_position_embeddings == 256
    tok = AutoTokenizer.from_pretrained(release)
    assert tok(PROMPT, add_special_tokens=False).input_ids == K3Tokenizer.from_file(release).encode(PROMPT)


def test_logits_and_loss_equal_k3s_forward(release, hf_model, k3_model):
    ids = torch.tensor([prompt_ids(release)])
    with torch.no_grad():
        want = k3_model(ids).logits
        out = hf_model(ids, labels=ids)
    assert out.logits.dtype == torch.float32
    assert_rel_close(out.logits, want)
    loss = F.cross_entropy(want[0, :-1].double(), ids[0, 1:])
    assert abs(out.loss.item() - loss.item()) <= 1e-5 * loss.item()


def test_cache_carries_k3s_state(release, hf_model, k3_model):
    """Prefill then one-token steps through a K3Cache reproduce the full forward's logits at every position."""
    ids = torch.tensor([prompt_ids(release)])
    with torch.no_grad():
        want = k3_model(ids).logits
        out = hf_model(ids[:, :5], use_cache=True)
        cache = getattr(out, CACHE_KWARG)
        assert isinstance(cache, K3Cache) and cache.get_seq_length() == 5
        steps = [out.logits]
        for t in range(5, ids.shape[1]):
            steps.append(hf_model(ids[:, t:t + 1], **{CACHE_KWARG: cache}).logits)
    assert cache.get_seq_length() == ids.shape[1]
    assert_rel_close(torch.cat(steps, dim=1), want, rel=1e-4)


def test_greedy_generate_equals_k3_generate(release, hf_model, k3_model):
    prompt = prompt_ids(release)
    eos = hf_model.generation_config.eos_token_id
    want = list(generate_tokens(k3_model, prompt, max_tokens=12, temperature=0, stop_ids=(eos,)))
    fed = []
    forward = hf_model.k3_model.forward

    def spy(tokens, state=None, **kw):
        fed.append(tokens.shape[1])
        return forward(tokens, state=state, **kw)

    hf_model.k3_model.forward = spy
    try:
        with torch.no_grad():
            got = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    finally:
        del hf_model.k3_model.forward
    assert got[0, :len(prompt)].tolist() == prompt
    assert got[0, len(prompt):].tolist() == want
    assert fed == [len(prompt)] + [1] * (len(want) - 1)  # the prompt once, then only the new token


def test_batched_generate_without_padding_and_padded_batches_refused(release, hf_model):
    prompt = prompt_ids(release)
    other = [prompt[0]] + prompt[:0:-1]  # same length, different tokens
    with torch.no_grad():
        both = hf_model.generate(torch.tensor([prompt, other]), max_new_tokens=4, do_sample=False)
        one = [hf_model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False)[0] for p in (prompt, other)]
    assert both[0].tolist() == one[0].tolist() and both[1].tolist() == one[1].tolist()
    mask = torch.ones(2, len(prompt), dtype=torch.long)
    mask[1, :2] = 0
    with pytest.raises(NotImplementedError, match="no padding mask.*one prompt at a time"):
        hf_model.generate(torch.tensor([prompt, other]), attention_mask=mask, max_new_tokens=2, do_sample=False)
    with pytest.raises(NotImplementedError, match="beam search"):
        hf_model.generate(torch.tensor([prompt]), num_beams=2, max_new_tokens=2, do_sample=False)


def test_save_pretrained_writes_a_k3_release(release, hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path / "saved")
    cfg, sd = load_release(tmp_path / "saved")
    _, want = load_release(release)
    assert cfg == CFG and sorted(sd) == sorted(want) and all(torch.equal(sd[k], want[k]) for k in want)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert sorted(again.state_dict()) == sorted(want)


def test_from_pretrained_refuses_what_it_cannot_honour(release):
    for device_map in ("auto", "sequential", {"": "cpu"}):
        with pytest.raises(NotImplementedError, match="one device"):
            AutoModelForCausalLM.from_pretrained(release, device_map=device_map)
    with pytest.raises(TypeError, match="load_in_8bit"):
        AutoModelForCausalLM.from_pretrained(release, load_in_8bit=True)
    other = K3Config.from_model_config(ModelConfig(d_model=96))
    with pytest.raises(ValueError, match="d_model"):
        K3ForCausalLM.from_pretrained(release, config=other)


def test_dtype_keeps_k3s_fp32_tensors(release):
    m = AutoModelForCausalLM.from_pretrained(release, dtype=torch.bfloat16)
    sd = m.state_dict()
    assert sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for k, t in sd.items() if k.endswith(("A_log", "dt_bias")))


def test_a_new_model_is_k3s_init_and_wraps_k3s_modules():
    m = K3ForCausalLM(K3Config.from_model_config(CFG))
    want = build_model(CFG, seed=0).state_dict()
    got = m.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)  # post_init changed nothing
    assert m.model is m.k3_model.model and m.lm_head is m.k3_model.lm_head
    m.eval()
    assert not m.k3_model.training and not m.model.training
    m.train()
    assert m.k3_model.training


# ----------------------------------------------------------------------------------------------------------------
# k3 export-hf

ISOLATED = r"""
import importlib.util, json, sys
sys.path[:0] = json.loads(sys.argv[1])  # no .pth files are run: k3's editable install is not seen
assert importlib.util.find_spec("k3") is None, "k3 is importable"
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], trust_remote_code=True)
tok = AutoTokenizer.from_pretrained(sys.argv[2], trust_remote_code=True)
ids = torch.tensor([json.loads(sys.argv[3])])
with torch.no_grad():
    logits = model(ids).logits
    gen = model.generate(ids, max_new_tokens=int(sys.argv[4]), do_sample=False)
print(json.dumps({"transformers": transformers.__version__, "module": type(model).__module__, "k3": sorted(m for m in sys.modules if m.split(".")[0] == "k3"),
                  "names": sorted(model.state_dict()), "logits": logits.tolist(), "gen": gen[0].tolist(),
                  "tok": tok(json.loads(sys.argv[5]), add_special_tokens=False).input_ids}))
"""


def test_export_loads_without_k3(release, k3_model, tmp_path):
    res = runner.invoke(app, ["export-hf", str(release), "--out", str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    out = tmp_path / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["model_type"] == "k3"
    assert read_release_config(out) == CFG  # k3 itself still reads the exported directory
    tree = ast.parse((out / f"{ENTRY_MODULE}.py").read_text())
    sources = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                   and n.targets[0].id == "SOURCES")
    assert {"model.hf", "model.transformer", "model.checkpoint", "kernels.kda.chunk_torch"} <= set(sources)
    assert not [m for m in sources if "triton" in m]  # the PyTorch kernels only
    for name, (_, src) in sources.items():
        imported = [a.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [m for m in imported if m.split(".")[0] == "k3"], name
    prompt = prompt_ids(release)
    with torch.no_grad():
        want = k3_model(torch.tensor([prompt])).logits
    eos = json.loads((release / "generation_config.json").read_text())["eos_token_id"]
    want_gen = list(generate_tokens(k3_model, prompt, max_tokens=6, temperature=0, stop_ids=(eos,)))
    # site-packages and PYTHONPATH (another transformers under test), never k3's editable-install hook (a .pth file)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = list(dict.fromkeys([*extra, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    (tmp_path / "cwd").mkdir()
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", ISOLATED, json.dumps(paths), str(out), json.dumps(prompt),
                           "6", json.dumps(PROMPT)], cwd=tmp_path / "cwd", env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["module"].startswith("k3_hf_") and got["k3"] == []
    assert got["transformers"] == transformers.__version__  # the one under test here
    assert got["names"] == sorted(load_release(release)[1])
    assert_rel_close(torch.tensor(got["logits"]), want)
    assert got["gen"][len(prompt):] == want_gen
    assert got["tok"] == K3Tokenizer.from_file(release).encode(PROMPT)


def test_export_refuses_quantized_releases_with_the_fix(release, tmp_path):
    from k3.train.quantize import quantize_release

    q = quantize_release(release, tmp_path / "q", fmt="w4a8")
    with pytest.raises(CheckpointError, match=rf"quantized release.*export the bf16 / fp32 release.*"
                                              rf"k3 export-hf {release} --out"):
        export_hf(q, tmp_path / "hf")
    res = runner.invoke(app, ["export-hf", str(q), "--out", str(tmp_path / "hf")])
    assert res.exit_code == 2 and "quantized release" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "hf").exists()


def test_export_replaces_only_an_earlier_export(release, tmp_path):
    out = tmp_path / "hf"
    export_hf(release, out)
    (out / "stale.txt").write_text("x")
    export_hf(release, out)  # an earlier export is replaced whole
    assert not (out / "stale.txt").exists() and (out / f"{ENTRY_MODULE}.py").is_file()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="not a k3 export-hf output"):
        export_hf(release, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    with pytest.raises(CheckpointError, match="the checkpoint itself"):
        export_hf(release, release)


def test_cli_help_and_a_bad_checkpoint_path(tmp_path):
    res = runner.invoke(app, ["export-hf", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--out" in res.output and "trust_remote_code" in res.output, res.output
    res = runner.invoke(app, ["export-hf", str(tmp_path / "nope"), "--out", str(tmp_path / "hf")])
    assert res.exit_code == 2 and "checkpoint directory not found" in res.output, res.output
    assert "Traceback" not in res.output and not (tmp_path / "hf").exists()

