"""Release checkpoint IO (style.md section 5B): bit-exact round trips, export dtypes, HF layout, loud errors."""

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml
from safetensors import safe_open
from torch import nn

from k3.model.checkpoint import (
    SAFETENSORS_INDEX,
    CheckpointError,
    instantiate,
    load_release,
    load_state_into,
    save_release,
    trained_seq_len,
    validate_state_dict,
)
from k3.model.config import K3_FORMAT_VERSION, ModelConfig


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor: equality of these is bit-exactness (NaN payloads and -0.0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)  # safetensors stores tensors sorted, so the order is not kept
    for k, t in a.items():
        assert t.dtype == b[k].dtype, k
        assert t.shape == b[k].shape, k
        assert torch.equal(bits(t), bits(b[k])), k


def mixed_state_dict() -> dict[str, torch.Tensor]:
    sd = {
        "model.embed_tokens.weight": torch.randn(64, 16),
        "model.layers.0.self_attn.A_log": torch.randn(2),
        "model.layers.0.self_attn.dt_bias": torch.randn(32),
        "model.layers.1.mlp.gate.weight": torch.randn(8, 16).to(torch.bfloat16),
        "model.layers.1.mlp.gate.e_score_correction_bias": torch.randn(8) * 1e-3,
        "model.layers.1.mlp.experts.w_EFD": torch.randn(8, 4, 16).to(torch.float16),
        "model.norm.weight": torch.tensor([0.0, -0.0, float("nan"), 1.5]),
        "lm_head.weight": torch.randn(64, 16),
        "step_count": torch.tensor([7], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
    return sd


@pytest.fixture
def cfg() -> ModelConfig:
    return ModelConfig()


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "read"])
def test_round_trip_mixed_dtypes_is_bit_exact(tmp_path, cfg, mmap):
    sd = mixed_state_dict()
    out = save_release(tmp_path / "rel", sd, cfg)
    cfg2, sd2 = load_release(out, mmap=mmap)
    assert cfg2 == cfg
    assert_bit_equal(sd, sd2)


def test_fp32_export_of_fp32_tensors_is_bit_exact(tmp_path, cfg):
    sd = {k: v for k, v in mixed_state_dict().items() if v.dtype == torch.float32}
    _, sd2 = load_release(save_release(tmp_path / "rel", sd, cfg, dtype=torch.float32))
    assert_bit_equal(sd, sd2)
    assert json.loads((tmp_path / "rel" / "config.json").read_text())["torch_dtype"] == "float32"


def test_bf16_export_keeps_fp32_tensors(tmp_path, cfg):
    sd = mixed_state_dict()
    _, sd2 = load_release(save_release(tmp_path / "rel", sd, cfg, dtype="bfloat16"))
    keep = ("A_log", "dt_bias", "e_score_correction_bias")
    for k, v in sd.items():
        if not v.is_floating_point():
            assert sd2[k].dtype == v.dtype and torch.equal(sd2[k], v), k
        elif k.endswith(keep):
            assert sd2[k].dtype == torch.float32 and torch.equal(bits(sd2[k]), bits(v)), k
        else:
            assert sd2[k].dtype == torch.bfloat16, k
            assert torch.equal(bits(sd2[k]), bits(v.to(torch.bfloat16))), k
    assert json.loads((tmp_path / "rel" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_layout_metadata_and_config_fields(tmp_path, cfg):
    out = save_release(tmp_path / "rel", mixed_state_dict(), cfg, run_info={"git_sha": "abc123",
                                                                           "parent": tmp_path / "p"})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "k3_run.yaml",
                                                     "model.safetensors"]
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    conf = json.loads((out / "config.json").read_text())
    assert conf["model_type"] == "k3"
    assert conf["architectures"] == ["K3ForCausalLM"]
    assert conf["k3_format_version"] == K3_FORMAT_VERSION
    for k, v in cfg.to_dict().items():
        assert conf[k] == v, k
    run = yaml.safe_load((out / "k3_run.yaml").read_text())
    assert run["git_sha"] == "abc123" and run["parent"] == str(tmp_path / "p")
    gen = json.loads((out / "generation_config.json").read_text())
    assert {"temperature", "top_p", "max_new_tokens"} <= set(gen)


def test_wrapper_prefixes_are_stripped(tmp_path, cfg):
    w, b = torch.randn(3, 2), torch.randn(3)
    sd = {"module._orig_mod.lin.weight": w, "_orig_mod.lin.bias": b}
    _, sd2 = load_release(save_release(tmp_path / "rel", sd, cfg))
    assert sorted(sd2) == ["lin.bias", "lin.weight"]
    assert torch.equal(sd2["lin.weight"], w) and torch.equal(sd2["lin.bias"], b)
    with pytest.raises(CheckpointError, match="after stripping"):
        save_release(tmp_path / "rel2", {"module.w": w, "w": w}, cfg)


def test_tied_and_shared_tensors(tmp_path):
    emb = torch.randn(10, 4)
    big = torch.randn(8)
    sd = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "a": big[:4], "b": big[4:]}
    tied = ModelConfig(tie_word_embeddings=True)
    _, sd2 = load_release(save_release(tmp_path / "tied", sd, tied))
    assert sorted(sd2) == ["a", "b", "model.embed_tokens.weight"]  # one copy of the tied tensor
    assert torch.equal(sd2["a"], big[:4]) and torch.equal(sd2["b"], big[4:])
    _, sd3 = load_release(save_release(tmp_path / "untied", sd, ModelConfig()))
    assert sorted(sd3) == sorted(sd) and torch.equal(sd3["lm_head.weight"], emb)


@pytest.fixture
def tokenizer_dir(tmp_path) -> Path:
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "def": 1, "x": 2}, unk_token="<unk>"))
    tok.add_special_tokens(["<|bos|>", "<|eos|>", "<|pad|>"])
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": {"content": "<|eos|>"}, "pad_token": "<|pad|>"}))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    return d


def test_tokenizer_files_and_generation_ids(tmp_path, cfg, tokenizer_dir):
    from tokenizers import Tokenizer

    out = save_release(tmp_path / "rel", mixed_state_dict(), cfg, tokenizer_dir=tokenizer_dir,
                       generation_config={"max_new_tokens": 64})
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / f).read_bytes() == (tokenizer_dir / f).read_bytes()
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["bos_token_id"] == tok.token_to_id("<|bos|>")
    assert gen["eos_token_id"] == tok.token_to_id("<|eos|>")
    assert gen["pad_token_id"] == tok.token_to_id("<|pad|>")
    assert gen["max_new_tokens"] == 64
    # the tokenizer.json file itself is accepted too
    out2 = save_release(tmp_path / "rel2", mixed_state_dict(), cfg, tokenizer_dir=tokenizer_dir / "tokenizer.json")
    assert json.loads((out2 / "generation_config.json").read_text()) == {**gen, "max_new_tokens": 256}
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        save_release(tmp_path / "rel3", mixed_state_dict(), cfg, tokenizer_dir=tmp_path / "nowhere")


def test_replace_existing_release(tmp_path, cfg, tokenizer_dir):
    out = tmp_path / "rel"
    first = {"w": torch.randn(4, 4)}
    save_release(out, first, cfg)
    second = {"w": torch.randn(4, 4), "v": torch.randn(2)}
    (tmp_path / ".tmp-rel-deadbeef").mkdir()  # left by a killed writer
    save_release(out, second, cfg)
    assert_bit_equal(second, load_release(out)[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rel", "tok"]  # no temp or set-aside directories left
    # a write that fails midway (bos token not in the vocab) leaves the existing release untouched
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|nope|>"}))
    with pytest.raises(CheckpointError, match="bos_token"):
        save_release(out, {"w": torch.zeros(1)}, cfg, tokenizer_dir=tokenizer_dir)
    assert_bit_equal(second, load_release(out)[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rel", "tok"]


def test_sharded_index_loading(tmp_path, cfg):
    sd = mixed_state_dict()
    out = save_release(tmp_path / "rel", sd, cfg)
    (out / "model.safetensors").unlink()
    names = list(sd)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    for fname, keys in shards.items():  # written with safetensors directly, not by k3
        safetensors.torch.save_file({k: sd[k] for k in keys}, out / fname)
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (out / SAFETENSORS_INDEX).write_text(json.dumps(index))
    assert_bit_equal(sd, load_release(out)[1])

    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_release(out)
    safetensors.torch.save_file({k: sd[k] for k in names[5:]}, out / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="disagree"):
        load_release(out)


def test_sharded_save(tmp_path, cfg):
    sd = mixed_state_dict()
    out = save_release(tmp_path / "rel", sd, cfg, max_shard_bytes=4096)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / SAFETENSORS_INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in sd.values())
    assert_bit_equal(sd, load_release(out)[1])


def _rewrite_config(path: Path, fn) -> None:
    conf = json.loads((path / "config.json").read_text())
    fn(conf)
    (path / "config.json").write_text(json.dumps(conf))


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


BAD_INPUTS = {
    "missing-dir": (lambda p: p.rename(p.parent / "moved"), "rel", "not found"),
    "not-a-dir": (lambda p: (p.rename(p.parent / "moved"), p.write_text("x")), "rel", "not a directory"),
    "no-config": (lambda p: (p / "config.json").unlink(), "config.json", "missing config.json"),
    "bad-json": (lambda p: (p / "config.json").write_text("{\"model_type\": "), "config.json", "invalid JSON"),
    "foreign": (lambda p: _rewrite_config(p, lambda c: c.update(model_type="llama")), "config.json", "foreign"),
    "newer": (lambda p: _rewrite_config(p, lambda c: c.update(k3_format_version=K3_FORMAT_VERSION + 1)),
              "config.json", "upgrade k3"),
    "no-version": (lambda p: _rewrite_config(p, lambda c: c.pop("k3_format_version")), "config.json",
                   "k3_format_version is missing"),
    "unknown-key": (lambda p: _rewrite_config(p, lambda c: c.update(d_modle=8)), "config.json", "d_model"),
    "bad-value": (lambda p: _rewrite_config(p, lambda c: c.update(n_layers="many")), "config.json", "n_layers"),
    "no-weights": (lambda p: (p / "model.safetensors").unlink(), "model.safetensors", "missing weights"),
    "truncated": (lambda p: _truncate(p / "model.safetensors"), "model.safetensors", "corrupt or truncated"),
    "garbage": (lambda p: (p / "model.safetensors").write_bytes(b"\xff" * 64), "model.safetensors", "corrupt"),
    "bad-index": (lambda p: ((p / "model.safetensors").unlink(), (p / SAFETENSORS_INDEX).write_text("[]")),
                  SAFETENSORS_INDEX, "invalid index"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_release_raises_naming_the_file(tmp_path, cfg, case):
    out = save_release(tmp_path / "rel", mixed_state_dict(), cfg)
    mutate, fname, phrase = BAD_INPUTS[case]
    mutate(out)
    with pytest.raises(CheckpointError) as e:
        load_release(out)
    msg = str(e.value)
    assert fname in msg and phrase in msg, msg


def test_training_checkpoint_and_run_dir_hints(tmp_path, cfg):
    save_release(tmp_path / "run" / "final", {"w": torch.ones(1)}, cfg)
    with pytest.raises(CheckpointError, match="did you mean"):
        load_release(tmp_path / "run")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "train_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="training checkpoint"):
        load_release(tmp_path / "ck")


class Tiny(nn.Module):
    """Tied embedding/head, an fp32-kept parameter and a non-persistent buffer (built by its constructor)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.A_log = nn.Parameter(torch.zeros(2))
        self.register_buffer("inv_freq", torch.arange(3.0), persistent=False)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros(1, dtype=torch.int64))


def test_validate_state_dict_messages():
    m = Plain()
    sd = {"lin.weight": torch.zeros(2, 4), "extra.w": torch.zeros(1), "count": torch.zeros(1, dtype=torch.int64)}
    with pytest.raises(CheckpointError) as e:
        validate_state_dict(m, sd)
    msg = str(e.value)
    assert "missing keys: lin.bias" in msg
    assert "unexpected keys: extra.w" in msg
    assert "lin.weight: checkpoint (2, 4) vs model (2, 3)" in msg
    validate_state_dict(m, m.state_dict())


def test_instantiate_meta_path_and_ties(tmp_path):
    src = Plain()
    m = instantiate(Plain, dict(src.state_dict()))
    assert_bit_equal(src.state_dict(), m.state_dict())
    assert not any(t.is_meta for t in m.state_dict().values())

    tiny = Tiny()
    tiny.A_log.data.normal_()
    out = save_release(tmp_path / "t", tiny.state_dict(), ModelConfig(tie_word_embeddings=True))
    _, sd = load_release(out)
    assert set(sd) == {"embed.weight", "A_log"}
    m2 = instantiate(Tiny, sd, dtype="bfloat16")
    assert m2.head.weight is m2.embed.weight  # tie restored, one Parameter
    assert m2.embed.weight.dtype == torch.bfloat16 and m2.A_log.dtype == torch.float32
    assert torch.equal(m2.A_log, tiny.A_log)
    assert torch.equal(m2.inv_freq, torch.arange(3.0))  # non-persistent buffer from the constructor, not meta

    m3 = load_state_into(Tiny(), sd)  # copy into an existing model (--init): the saved-once tie is accepted
    assert m3.head.weight is m3.embed.weight and torch.equal(m3.head.weight, tiny.embed.weight)
    with pytest.raises(CheckpointError, match="missing keys: A_log"):
        load_state_into(Tiny(), {"embed.weight": sd["embed.weight"]})


def test_load_model_round_trip(tmp_path):
    transformer = pytest.importorskip("k3.model.transformer")
    from k3.model.checkpoint import load_model

    cfg = ModelConfig()
    model = transformer.K3Model(cfg)
    out = save_release(tmp_path / "rel", model.state_dict(), cfg)
    loaded, cfg2 = load_model(out)
    assert cfg2 == cfg
    ref = dict(model.state_dict())
    got = dict(loaded.state_dict())
    assert sorted(ref) == sorted(got)
    for k, t in ref.items():
        assert torch.equal(bits(t), bits(got[k])), k


def test_trained_seq_len_from_the_run_record(tmp_path, cfg):
    sd = {"w": torch.randn(2)}
    plain = save_release(tmp_path / "plain", sd, cfg)
    assert trained_seq_len(plain) is None  # nothing recorded: no claim
    trained = save_release(tmp_path / "trained", sd, cfg, run_info={"config": {"data": {"seq_len": 256}}})
    assert trained_seq_len(trained) == 256
    derived = save_release(tmp_path / "derived", sd, cfg,
                           run_info={"parent_run": yaml.safe_load((Path(trained) / "k3_run.yaml").read_text())})
    assert trained_seq_len(derived) == 256  # a quantized release records its source run as parent_run
    (Path(derived) / "k3_run.yaml").write_text("config: [unclosed\n")
    with pytest.raises(CheckpointError, match="k3_run.yaml: not readable YAML"):
        trained_seq_len(derived)
