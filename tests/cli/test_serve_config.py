"""The serve and kernels sections of the root config: presets, precedence (defaults < preset < file < flag shortcuts <
--set), strict values, `k3 serve`'s flags as shortcuts, and the kernel settings applied once and recorded with the
environment overrides that applied."""

import pytest
import typer
import yaml
from typer.testing import CliRunner

from k3.cli.config import apply_kernels, list_presets, resolve_config
from k3.kernels import KernelConfig, configure
from k3.model.config import ConfigError


@pytest.fixture(autouse=True)
def _restore_kernel_config(monkeypatch):
    """Tests here apply kernel configs: put the process's back (defaults + the test environment) afterwards."""
    for var in ("K3_KERNELS", "K3_KDA_BWD", "K3_KDA_RECOMPUTE", "K3_KDA_FP32_DOTS"):
        monkeypatch.delenv(var, raising=False)
    yield
    monkeypatch.undo()
    configure(KernelConfig())


def test_every_serve_preset_resolves():
    assert "default" in list_presets("serve") and "gpu-throughput" in list_presets("serve")
    for name in list_presets("serve"):
        cfg = resolve_config("serve", preset=name)
        assert cfg.serve is not None and cfg.kernels is not None and cfg.model is None and cfg.train is None
    fast = resolve_config("serve", preset="gpu-throughput").serve
    assert fast.compile_decode and fast.cuda_graph_batches == [1, 32] and fast.max_num_seqs == 32


def test_serve_precedence_preset_file_flags_set(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump({"serve": {"max_num_seqs": 3, "max_queue": 7, "port": 9000}}))
    cfg = resolve_config("serve", preset="gpu-throughput", config_files=[str(f)],
                         overrides={"serve": {"port": 9100, "max_queue": 8}}, sets=["serve.max_queue=9"])
    s = cfg.serve
    assert s.compile_decode  # the preset
    assert s.max_num_seqs == 3  # the file beats the preset
    assert s.port == 9100  # a flag shortcut beats the file
    assert s.max_queue == 9  # --set beats everything
    assert resolve_config("serve", preset="default").serve.port == 8000  # ServeConfig's default


def test_serve_and_kernel_values_are_checked():
    with pytest.raises(ConfigError, match="serve: dtype must be one of"):
        resolve_config("serve", preset="default", sets=["serve.dtype=fp8"])
    with pytest.raises(ConfigError, match="unknown config key 'serve.max_batch'.*max_num_batched_tokens"):
        resolve_config("serve", preset="default", sets=["serve.max_batch=4"])
    with pytest.raises(ConfigError, match="serve.port"):
        resolve_config("serve", preset="default", sets=["serve.port=eighty"])
    with pytest.raises(ConfigError, match="kernels: KernelConfig.kda_fp32_dots must be one of"):
        resolve_config("serve", preset="default", sets=["kernels.kda_fp32_dots=fp64"])
    with pytest.raises(ConfigError, match="unknown serve preset 'fastest'.*gpu-throughput"):
        resolve_config("serve", preset="fastest")
    with pytest.raises(ConfigError, match="section 'train' is not used by `k3 serve`"):
        resolve_config("serve", preset="default", sets=["train.max_steps=3"])
    with pytest.raises(ConfigError, match="section 'serve' is not used by `k3 pretrain`"):
        resolve_config("pretrain", preset="debug", sets=["serve.port=1"])


def test_apply_kernels_records_the_environment_overrides(monkeypatch):
    cfg = resolve_config("pretrain", preset="debug", sets=["kernels.backend=torch", "kernels.kda_recompute=true"])
    rec = apply_kernels(cfg)
    assert rec == {"effective": {"backend": "torch", "kda_backward": "triton", "kda_recompute": True,
                                 "kda_fp32_dots": "tf32x3"}, "env_overrides": {}}
    monkeypatch.setenv("K3_KDA_FP32_DOTS", "ieee")
    rec = apply_kernels(cfg)
    assert rec["effective"]["kda_fp32_dots"] == "ieee" and rec["env_overrides"] == {"K3_KDA_FP32_DOTS": "ieee"}
    monkeypatch.setenv("K3_KDA_BWD", "cuda")
    with pytest.raises(ConfigError, match="kernels: K3_KDA_BWD"):
        apply_kernels(cfg)


def _serve_cli(monkeypatch, args):
    """Run `k3 serve ARGS` with run_server replaced: returns the ServeConfig it would serve."""
    import k3.serve.server as server_mod
    from k3.cli.commands.serve import serve

    got = []
    monkeypatch.setattr(server_mod, "run_server", got.append)
    app = typer.Typer()
    app.command("serve")(serve)
    res = CliRunner().invoke(app, args)
    return res, got[0] if got else None


def test_serve_flags_are_shortcuts_for_serve_fields(monkeypatch, tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump({"serve": {"max_num_seqs": 5, "max_queue": 40}}))
    monkeypatch.delenv("K3_API_KEY", raising=False)
    res, cfg = _serve_cli(monkeypatch, ["ck", "--config", str(f), "--max-batch", "6", "--port", "8123",
                                        "--no-prefix-caching", "--no-cuda-graphs", "--cuda-graph-batches", "1,4",
                                        "--api-key", "a", "--api-key", "b", "--set", "serve.port=8124"])
    assert res.exit_code == 0, res.output
    assert cfg.ckpt == "ck" and cfg.max_num_seqs == 6 and cfg.max_queue == 40 and cfg.port == 8124
    assert not cfg.enable_prefix_caching and not cfg.cuda_graphs and cfg.cuda_graph_batches == [1, 4]
    assert cfg.api_keys == ["a", "b"] and cfg.host == "127.0.0.1"  # unset shortcuts leave the defaults
    monkeypatch.setenv("K3_API_KEY", "from-env")
    res, cfg = _serve_cli(monkeypatch, ["ck", "--preset", "gpu-throughput"])
    assert res.exit_code == 0 and cfg.api_keys == ["from-env"] and cfg.compile_decode and cfg.max_num_seqs == 32
    res, cfg = _serve_cli(monkeypatch, ["ck", "--set", "serve.max_num_seqs=0.5"])
    assert res.exit_code == 2 and cfg is None and "serve.max_num_seqs" in res.output
    res, cfg = _serve_cli(monkeypatch, ["ck", "--cuda-graph-batches", "1,x"])
    assert res.exit_code == 2 and "comma-separated" in res.output and "cuda-graph-batches" in res.output
