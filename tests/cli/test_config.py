"""Config loader (style.md section 4): precedence, strict keys and types, readable errors, presets valid."""

import pytest

from k3.cli.config import K3Config, list_presets, parse_set, read_preset, resolve_config
from k3.model.config import ConfigError, ModelConfig


def test_every_preset_resolves():
    for name in list_presets("model"):
        ModelConfig.from_dict(read_preset("model", name))
    for name in list_presets("pretrain"):
        cfg = resolve_config("pretrain", preset=name)
        assert isinstance(cfg, K3Config) and cfg.model is not None and cfg.train is not None


def test_precedence_defaults_preset_file_set(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  max_steps: 7\n  batch_size: 3\noptim:\n  lr: 1e-4\n")
    cfg = resolve_config("pretrain", preset="debug", config_files=[str(f)], sets=["train.max_steps=9"])
    assert cfg.train.max_steps == 9  # --set beats the file
    assert cfg.train.batch_size == 3  # the file beats the preset
    assert cfg.optim.lr == pytest.approx(1e-4)  # YAML's string '1e-4' is coerced to float
    assert cfg.model.name == "k3-debug"  # preset's named model
    assert cfg.train.log_every == 10  # preset value kept


def test_set_model_field_overrides_named_model():
    cfg = resolve_config("pretrain", preset="debug", sets=["model.d_model=96", "model.full_attn_layers=[2,4]"])
    assert cfg.model.d_model == 96 and cfg.model.full_attn_layers == [2, 4]
    assert cfg.model.vocab_size == 512


def test_unknown_key_names_close_match():
    with pytest.raises(ConfigError, match="train.max_step.*did you mean max_steps"):
        resolve_config("pretrain", preset="debug", sets=["train.max_step=5"])
    with pytest.raises(ConfigError, match="unknown config section 'trian'.*train"):
        resolve_config("pretrain", preset="debug", sets=["trian.max_steps=5"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match="train.max_steps: expected an integer"):
        resolve_config("pretrain", preset="debug", sets=["train.max_steps=lots"])
    with pytest.raises(ConfigError, match="train.compile: expected true/false"):
        resolve_config("pretrain", preset="debug", sets=["train.compile=maybe"])
    with pytest.raises(ConfigError, match="model.mla_position"):
        resolve_config("pretrain", preset="debug", sets=["model.mla_position=alibi"])


def test_unknown_preset_lists_available():
    with pytest.raises(ConfigError, match="unknown pretrain preset 'huge'.*debug"):
        resolve_config("pretrain", preset="huge")


def test_parse_set_errors():
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_set("max_steps")
    with pytest.raises(ConfigError, match="section.key"):
        parse_set("max_steps=3")
    assert parse_set("a.b.c=1") == {"a": {"b": {"c": 1}}}


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        resolve_config("pretrain", preset="debug", config_files=[str(tmp_path / "nope.yaml")])


def test_slots_reject_typos_on_assignment():
    cfg = resolve_config("pretrain", preset="debug")
    with pytest.raises(AttributeError):
        cfg.trian = 1  # type: ignore[attr-defined]


def test_every_field_is_documented_and_reference_is_current():
    import dataclasses
    from pathlib import Path

    from k3.cli.config import SECTIONS
    from k3.cli.docs import reference, section_rows

    for section, cls in SECTIONS.items():
        documented = {row[0] for row in section_rows(cls)}
        missing = {f.name for f in dataclasses.fields(cls)} - documented
        assert not missing, f"{section}: fields without a trailing comment: {missing}"
    committed = (Path(__file__).resolve().parents[2] / "k3cli" / "README.md").read_text()
    assert committed.strip() == reference().strip(), "k3cli/README.md is stale: run python -m k3.cli.docs > k3cli/README.md"
