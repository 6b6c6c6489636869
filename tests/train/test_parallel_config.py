"""parallel.* (ParallelConfig): validation as a pure function, the root config's section, and the counted EP
dispatch bytes of latent against full-width all-to-all (k3.train.parallel.comm)."""

import pytest
import torch

from k3.cli.config import COMMAND_SECTIONS, ConfigError, load_model_config, resolve_config
from k3.model.config import ModelConfig
from k3.train.config import ParallelConfig
from k3.train.parallel.comm import ep_dispatch_bytes


def test_valid_layouts():
    assert ParallelConfig().validate(world_size=1, num_experts=8, seq_len=256).dp == 1
    ParallelConfig(dp=2, ep=2).validate(world_size=4, num_experts=8)
    ParallelConfig(ep=4, cp=2, redundant_experts=2).validate(world_size=8, num_experts=16, seq_len=512)
    ParallelConfig(dp=3).validate()  # without a world size only the sizes themselves are checked


def test_product_must_equal_the_world_size():
    with pytest.raises(ValueError, match=r"2 x 2 x 1 = 4, but the world size is 2; launch 4 processes"):
        ParallelConfig(dp=2, ep=2).validate(world_size=2)


@pytest.mark.parametrize(("kw", "check", "match"), [
    ({"ep": 3}, {"num_experts": 8}, r"parallel.ep=3 must divide model.num_experts=8"),
    ({"cp": 3}, {"seq_len": 256}, r"parallel.cp=3 must divide data.seq_len=256"),
    ({"redundant_experts": 1}, {}, r"needs expert parallelism: set parallel.ep > 1"),
    ({"ep": 2, "redundant_experts": 5}, {"num_experts": 8}, r"more than the 4 experts .* use at most 4"),
    ({"dp": 0}, {}, r"parallel.dp must be an integer >= 1, got 0"),
    ({"ep": True}, {}, r"parallel.ep must be an integer >= 1, got True"),
    ({"redundant_experts": -1}, {}, r"parallel.redundant_experts must be an integer >= 0"),
])
def test_bad_layouts_name_the_key(kw, check, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kw).validate(**check)


def test_root_config_section():
    sections = (*COMMAND_SECTIONS["pretrain"], "parallel")
    cfg = resolve_config("pretrain", preset="debug", sections=sections,
                         sets=["parallel.ep=2", "parallel.redundant_experts=1"])
    assert (cfg.parallel.dp, cfg.parallel.ep, cfg.parallel.cp, cfg.parallel.redundant_experts) == (1, 2, 1, 1)
    with pytest.raises(ConfigError, match=r"parallel.ep=3 must divide model.num_experts=8"):
        resolve_config("pretrain", preset="debug", sections=sections, sets=["parallel.ep=3"])
    with pytest.raises(ConfigError, match="unknown field|did you mean"):
        resolve_config("pretrain", preset="debug", sections=sections, sets=["parallel.epp=2"])
    # k3 pretrain reads the section (data parallelism runs: test_distributed_*.py); the other commands refuse it
    assert resolve_config("pretrain", preset="debug", sets=["parallel.dp=2"]).parallel.dp == 2
    with pytest.raises(ConfigError, match="section 'parallel' is not used by `k3 extend-context`"):
        resolve_config("extend-context", preset=None, sets=["parallel.dp=2"])
    with pytest.raises(ConfigError, match=r"parallel.timeout_s must be a number of seconds > 0, got 0"):
        resolve_config("pretrain", preset="debug", sets=["parallel.timeout_s=0"])


def _counted_bytes(width, top_k, ep, dtype):
    """Bytes on the wire, counted from tensors: a balanced routing of ep * ep tokens (token t on rank t % ep, its
    j-th row to rank (t // ep + j) % ep), the remote rows in `width` sent to the expert and back."""
    remote = sum((t // ep + j) % ep != t % ep for t in range(ep * ep) for j in range(top_k))
    rows = torch.zeros(remote, width, dtype=dtype)
    return 2 * rows.nbytes / (ep * ep)  # dispatch + combine, per token


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_dispatch_bytes_debug_preset(ep):
    m = load_model_config("k3-debug")
    got = ep_dispatch_bytes(m, ep, dtype_bytes=2)
    assert got["latent_layer"] == pytest.approx(_counted_bytes(m.moe_latent_size, m.num_experts_per_tok, ep,
                                                               torch.bfloat16))
    assert got["full_layer"] == pytest.approx(_counted_bytes(m.d_model, m.num_experts_per_tok, ep, torch.bfloat16))
    assert got["latent_step"] == pytest.approx(2 * 3 * got["latent_layer"])  # 3 MoE layers, forward + backward
    assert got["ratio"] == 0.5
    if ep == 2:
        assert (got["latent_layer"], got["full_layer"]) == (128.0, 256.0)  # the docstring's example


def test_k3_latent_top16_sends_what_k2_sent_at_full_width_top8():
    k3 = ep_dispatch_bytes(ModelConfig(d_model=7168, moe_latent_size=3584, num_experts_per_tok=16), 64)
    k2 = ep_dispatch_bytes(ModelConfig(d_model=7168, moe_latent_size=7168, num_experts_per_tok=8), 64)
    assert k3["latent_layer"] == k2["full_layer"] == pytest.approx(2 * 16 * 3584 * 2 * 63 / 64)
    with pytest.raises(ValueError, match="dtype_bytes"):
        ep_dispatch_bytes(ModelConfig(), 2, dtype_bytes=3)


@pytest.mark.parametrize(("world", "kw", "experts", "match"), [
    (4, {"ep": 3}, 9, r"parallel.ep=3 does not divide the world size 4: .* launch a multiple of 3 processes"),
    (4, {"dp": 2, "ep": 2}, 6, r"parallel.dp=2 x parallel.ep=2: .* model.num_experts \(6\) must be divisible by 4"),
    (4, {"dp": 1, "ep": 2}, 8, r"2 x 1 = 2, but the world size is 4"),
])
def test_expert_layouts_refused_before_the_process_group(monkeypatch, world, kw, experts, match):
    # start_distributed raises before init_process_group: the launcher's environment is all it reads
    from k3.train.parallel.runtime import start_distributed

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=match):
        start_distributed(ParallelConfig(**kw), "cpu", "k3 pretrain", num_experts=experts, seq_len=256)
