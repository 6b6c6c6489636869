"""KernelConfig (k3kernels/config.py) and k3.kernels.configure: defaults, validation, the environment overrides (read at
configure, reported), and that the applied values reach the dispatch and the KDA kernels. Each test starts from a
process that never configured (conftest's kernel_config_restored) with none of the four variables set."""

import ast
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import k3.kernels
from k3.kernels import KernelConfig, configure, dispatch
from k3.kernels.config import ENV_VARS

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture(autouse=True)
def no_kernel_env(monkeypatch):
    for var in ENV_VARS.values():  # tests/conftest.py sets K3_KERNELS=torch for the whole run
        monkeypatch.delenv(var, raising=False)


def test_defaults_are_todays_behaviour():
    cfg = KernelConfig()
    assert (cfg.backend, cfg.kda_backward, cfg.kda_recompute, cfg.kda_fp32_dots) == ("auto", "triton", False, "tf32x3")
    assert cfg.validate() is cfg
    assert configure(KernelConfig()) == (KernelConfig(), {})
    assert dispatch.active_config() == KernelConfig()
    assert set(ENV_VARS.values()) == {"K3_KERNELS", "K3_KDA_BWD", "K3_KDA_RECOMPUTE", "K3_KDA_FP32_DOTS"}
    assert set(ENV_VARS) == {f.name for f in dataclasses.fields(KernelConfig)}  # every field has its variable


def test_keyword_only_slots_dataclass_exported_from_k3_kernels():
    assert k3.kernels.KernelConfig is KernelConfig and k3.kernels.configure is configure
    with pytest.raises(TypeError):
        KernelConfig("torch")  # keyword-only
    with pytest.raises(AttributeError):
        KernelConfig().kda_typo = 1  # slots: no stray attributes


def test_config_module_is_standard_library_only():
    tree = ast.parse((Path(k3.kernels.__file__).parent / "config.py").read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert mods <= set(sys.stdlib_module_names), mods - set(sys.stdlib_module_names)


@pytest.mark.parametrize("field,bad,allowed", [
    ("backend", "cuda", "('auto', 'torch', 'triton')"),
    ("kda_backward", "fla", "('triton', 'torch')"),
    ("kda_fp32_dots", "fp8", "('ieee', 'tf32x3', 'tf32')"),
])
def test_bad_values_name_the_field_the_value_and_the_choices(field, bad, allowed):
    msg = f"KernelConfig.{field} must be one of {allowed}, got '{bad}'"
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        KernelConfig(**{field: bad}).validate()
    with pytest.raises(ValueError, match=f"KernelConfig.{field}"):
        configure(KernelConfig(**{field: bad}))
    assert dispatch._CONFIG is None  # nothing applied


def test_recompute_must_be_a_bool():
    with pytest.raises(ValueError, match="KernelConfig.kda_recompute must be True or False, got 'yes'"):
        KernelConfig(kda_recompute="yes").validate()


def test_environment_overrides_win_and_are_reported(monkeypatch):
    monkeypatch.setenv("K3_KDA_BWD", "Torch")
    monkeypatch.setenv("K3_KDA_RECOMPUTE", "1")
    monkeypatch.setenv("K3_KDA_FP32_DOTS", "")  # empty: unset
    cfg, overrides = configure(KernelConfig(kda_backward="triton", kda_fp32_dots="ieee"))
    assert cfg == KernelConfig(kda_backward="torch", kda_recompute=True, kda_fp32_dots="ieee")
    assert overrides == {"K3_KDA_BWD": "Torch", "K3_KDA_RECOMPUTE": "1"}
    assert dispatch.active_config() == cfg
    monkeypatch.setenv("K3_KDA_RECOMPUTE", "0")  # read at configure: a later change waits for the next call
    assert dispatch.active_config().kda_recompute is True
    assert configure(KernelConfig(kda_recompute=True))[0].kda_recompute is False


@pytest.mark.parametrize("var,value,msg", [
    ("K3_KERNELS", "cuda", "K3_KERNELS='cuda' is not a kernel backend"),
    ("K3_KDA_BWD", "bogus", "K3_KDA_BWD must be 'triton' or 'torch', got 'bogus'"),
    ("K3_KDA_RECOMPUTE", "sometimes", "K3_KDA_RECOMPUTE must be 0 .* or 1 .*, got 'sometimes'"),
    ("K3_KDA_FP32_DOTS", "fp8", r"K3_KDA_FP32_DOTS must be one of \('ieee', 'tf32x3', 'tf32'\), got 'fp8'"),
])
def test_bad_environment_values_name_the_variable(monkeypatch, var, value, msg):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=msg):
        configure(KernelConfig())
    with pytest.raises(ValueError, match=msg):  # never configured: the first kernel call applies the environment
        dispatch.active_config()


def test_without_configure_the_environment_decides_once(monkeypatch):
    monkeypatch.setenv("K3_KERNELS", "torch")
    monkeypatch.setenv("K3_KDA_FP32_DOTS", "tf32")
    assert dispatch.kernel_backend() == "torch"
    assert dispatch.active_config() == KernelConfig(backend="torch", kda_fp32_dots="tf32")
    monkeypatch.setenv("K3_KDA_FP32_DOTS", "ieee")
    assert dispatch.active_config().kda_fp32_dots == "tf32"  # read once, as K3_KERNELS always was


def test_configure_changes_what_the_dispatch_resolves(monkeypatch):
    def torch_impl(*a, **kw):
        return "torch"

    configure(KernelConfig(backend="torch"))
    assert dispatch.kernel_backend() == "torch"
    assert dispatch.resolve("chunk_kda", torch_impl) is torch_impl
    if not HAS_TRITON:
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton without a GPU: the interpreter (nothing runs here)
    configure(KernelConfig(backend="triton"))  # forgets the cached "torch"
    assert dispatch.kernel_backend() == "triton"
    from k3.kernels.kda.chunk import chunk_kda_triton

    assert dispatch.resolve("chunk_kda", torch_impl) is chunk_kda_triton
    monkeypatch.setenv("K3_KERNELS", "torch")  # the override wins over the config's backend
    assert configure(KernelConfig(backend="triton")) == (KernelConfig(backend="torch"), {"K3_KERNELS": "torch"})
    assert dispatch.resolve("chunk_kda", torch_impl) is torch_impl


@pytest.mark.skipif(not HAS_TRITON, reason="the Triton kernel modules need the `triton` package")
def test_triton_backend_gives_the_kernels_cuda_tensors_only(monkeypatch):
    """On the triton backend of a GPU host every op's input on the CPU (a CPU model beside the GPU one) resolves to
    its PyTorch twin; under the interpreter the kernels take CPU tensors (how the CPU tests run them)."""
    def torch_impl(*a, **kw):
        return "torch"

    cpu = torch.zeros(1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the backend choice of a GPU host
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    configure(KernelConfig(backend="triton"))
    assert dispatch.kernel_backend() == "triton"
    for op in dispatch.TRITON_OPS:
        assert dispatch.resolve(op, torch_impl, like=cpu) is torch_impl, op
        assert dispatch.resolve(op, torch_impl) is not torch_impl, op  # no input named: the backend decides
    # the public ops name their input: on CPU tensors they compute what the torch backend computes
    from k3.kernels.glu import c2_glu
    from k3.kernels.kda import chunk_kda, fused_recurrent_kda
    from k3.kernels.mla import paged_mla_decode

    q, k, v = torch.randn(3, 1, 5, 2, 8)
    g, beta = -torch.rand(1, 5, 2, 8), torch.rand(1, 5, 2)
    q_lat, q_rope, pool = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 2), torch.randn(2, 64, 6)  # 64-token pages
    block_table, qpos = torch.tensor([[1, 0]]), torch.tensor([[70]])

    def ops():
        return (chunk_kda(q, k, v, g, beta)[0], fused_recurrent_kda(q, k, v, g, beta)[0], c2_glu(q, k),
                paged_mla_decode(q_lat, q_rope, pool, block_table, qpos, scale=0.5))

    on_triton = ops()
    configure(KernelConfig(backend="torch"))
    for name, a, b in zip(("chunk_kda", "fused_recurrent_kda", "c2_glu", "paged_mla_decode"), on_triton, ops()):
        assert torch.equal(a, b), name
    configure(KernelConfig(backend="triton"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for op in dispatch.TRITON_OPS:
        assert dispatch.resolve(op, torch_impl, like=cpu) is not torch_impl, op


@pytest.mark.skipif(not HAS_TRITON, reason="the Triton kernel modules need the `triton` package")
def test_kda_settings_reach_the_kernels():
    """backward_impl (which backward the chunk Function runs), keep_states (whether its forward keeps the states)
    and the fp32 dot precision of every chunk kernel, forward and backward, read the applied config."""
    from k3.kernels.kda.chunk import backward_impl, keep_states
    from k3.kernels.kda.triton.common import fp32_dot_precision
    from k3.kernels.kda.triton.launch import dot_prec

    assert (backward_impl(), keep_states(), fp32_dot_precision()) == ("triton", True, "tf32x3")
    configure(KernelConfig(kda_backward="torch", kda_recompute=True, kda_fp32_dots="ieee"))
    assert (backward_impl(), keep_states(), fp32_dot_precision()) == ("torch", False, "ieee")
    assert dot_prec("bwd_inter", torch.float32) == "ieee"
    configure(KernelConfig(kda_fp32_dots="tf32"))
    assert (backward_impl(), keep_states(), fp32_dot_precision()) == ("triton", True, "tf32")
