"""Schedules (architecture.md section 12): endpoints, plateau, monotone decay, purity; MTP weight switch."""

import dataclasses
import itertools
import math

import pytest

from k3.model.config import ConfigError
from k3.train.config import OptimConfig
from k3.train.schedule import lr_at, mtp_lambda_at, warmup_steps_for

T = 200


def cfg_for(schedule: str, **kw) -> OptimConfig:
    return OptimConfig(lr=2e-3, min_lr_ratio=0.1, schedule=schedule, **kw)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
@pytest.mark.parametrize("warmup", [None, 7])
def test_endpoints_and_warmup(schedule, warmup):
    cfg = cfg_for(schedule, warmup_steps=warmup)
    W = warmup_steps_for(cfg, T)
    assert lr_at(0, cfg, T) == 0.0
    assert lr_at(W, cfg, T) == pytest.approx(cfg.lr, rel=1e-12)
    ramp = [lr_at(t, cfg, T) for t in range(W + 1)]
    assert all(b > a for a, b in itertools.pairwise(ramp))  # strictly increasing warmup
    assert ramp[W // 2] == pytest.approx(cfg.lr * (W // 2) / W, rel=1e-12)  # linear
    end = cfg.lr if schedule == "constant" else cfg.min_lr_ratio * cfg.lr
    assert lr_at(T, cfg, T) == pytest.approx(end, rel=1e-12)
    assert lr_at(T + 50, cfg, T) == lr_at(T, cfg, T)  # held past the end


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_monotone_decay_after_warmup(schedule):
    cfg = cfg_for(schedule, warmup_steps=10)
    vals = [lr_at(t, cfg, T) for t in range(10, T + 1)]
    assert all(b <= a for a, b in itertools.pairwise(vals))
    assert vals[-1] < vals[0]


def test_cosine_matches_formula():
    cfg = cfg_for("cosine", warmup_steps=20)
    eta, eta_min, W = cfg.lr, cfg.min_lr_ratio * cfg.lr, 20
    for t in (20, 37, 110, 199):
        ref = eta_min + 0.5 * (eta - eta_min) * (1 + math.cos(math.pi * (t - W) / (T - W)))
        assert lr_at(t, cfg, T) == pytest.approx(ref, rel=1e-12)
    assert lr_at(W + (T - W) // 2, cfg, T) == pytest.approx((eta + eta_min) / 2, rel=1e-12)


def test_wsd_plateau_and_sqrt_cooldown():
    cfg = cfg_for("wsd", warmup_steps=10, wsd_decay_fraction=0.2)
    S = T - round(0.2 * T)  # decay starts at step 160
    assert all(lr_at(t, cfg, T) == cfg.lr for t in range(10, S + 1))  # exactly eta on the whole plateau
    assert lr_at(S + 1, cfg, T) < cfg.lr
    eta_min = cfg.min_lr_ratio * cfg.lr
    mid = S + (T - S) // 2
    assert lr_at(mid, cfg, T) == pytest.approx(eta_min + (cfg.lr - eta_min) * (1 - math.sqrt(0.5)), rel=1e-12)


def test_constant_is_flat_after_warmup():
    cfg = cfg_for("constant", warmup_steps=5)
    assert all(lr_at(t, cfg, T) == cfg.lr for t in range(5, T + 3))


def test_pure_function_of_step():
    cfg = cfg_for("cosine")
    before = dataclasses.asdict(cfg)
    forward = [lr_at(t, cfg, T) for t in range(T + 1)]
    backward = [lr_at(t, cfg, T) for t in reversed(range(T + 1))][::-1]
    assert forward == backward  # no hidden state: order of calls does not matter
    assert dataclasses.asdict(cfg) == before


@pytest.mark.parametrize("steps,expected", [(1000, 100), (50, 5), (100_000, 1000), (2, 1), (1, 0), (5000, 100)])
def test_default_warmup(steps, expected):
    assert warmup_steps_for(OptimConfig(), steps) == expected


def test_bad_inputs_raise():
    with pytest.raises(ConfigError, match="warmup_steps"):
        lr_at(0, cfg_for("cosine", warmup_steps=T), T)
    with pytest.raises(ConfigError, match="schedule"):
        lr_at(0, cfg_for("linear"), T)
    with pytest.raises(ValueError, match="step"):
        lr_at(-1, cfg_for("cosine"), T)


def test_mtp_lambda_switch():
    cfg = OptimConfig()  # 0.3 -> 0.1 at 70%
    assert mtp_lambda_at(0, cfg, 1000) == 0.3
    assert mtp_lambda_at(699, cfg, 1000) == 0.3
    assert mtp_lambda_at(700, cfg, 1000) == 0.1
    assert mtp_lambda_at(5000, cfg, 1000) == 0.1
