"""Learning-rate and MTP-weight schedules as pure functions of the optimizer step (architecture.md section 12).

Every function here depends only on (step, cfg, max_steps): no state, so a resumed run recomputes the same value
and a checkpoint needs no scheduler entry. Steps are 0-based optimizer steps; a run performs steps 0 .. T-1 with
T = max_steps, and step T is the (never taken) end point where the decay reaches its floor.

Schedules (η = cfg.lr, η_min = cfg.min_lr_ratio·η, W = warmup steps):

    warmup (all):  lr(t) = η·t/W                                          for t < W   (lr(0) = 0, lr(W) = η)
    cosine:        lr(t) = η_min + ½(η − η_min)(1 + cos(π(t − W)/(T − W)))  for W ≤ t ≤ T
    wsd:           lr(t) = η on the plateau W ≤ t ≤ S,  S = T − round(f·T)  (f = cfg.wsd_decay_fraction)
                   lr(t) = η_min + (η − η_min)(1 − sqrt((t − S)/(T − S)))    for S < t ≤ T
    constant:      lr(t) = η                                               for t ≥ W

Steps past T hold the value at T. Cosine: SGDR (Loshchilov & Hutter, arXiv 1608.03983). WSD: MiniCPM (arXiv
2404.06395); the 1−sqrt cooldown is Hägele et al. 2024 (arXiv 2405.18392), who found it matches cosine. WSD decays to
η_min (set cfg.min_lr_ratio = 0 for a decay to zero) so that both arms share one floor.
"""

from __future__ import annotations

import math

from k3.model.config import ConfigError
from k3.train.config import OptimConfig

SCHEDULES = ("cosine", "wsd", "constant")


def warmup_steps_for(cfg: OptimConfig, max_steps: int) -> int:
    """Warmup length W for a run of `max_steps` optimizer steps.

    cfg.warmup_steps=None picks W = max(1% of T, min(100, 10% of T)) (integer floors): architecture.md section 12
    proposes max(1%, 100); the 10% cap keeps short debug runs from spending their whole budget warming up. W is then
    clamped to [1, T-1], so lr(0) = 0 and at least one step runs at the peak. An explicit cfg.warmup_steps is used as
    given but must be < T. Example: T=1000 -> 100; T=50 -> 5; T=100_000 -> 1000.
    """
    if max_steps < 1:
        raise ConfigError(f"max_steps must be >= 1, got {max_steps}")
    if cfg.warmup_steps is not None:
        if not 0 <= cfg.warmup_steps < max_steps:
            raise ConfigError(f"optim.warmup_steps={cfg.warmup_steps} must lie in [0, max_steps={max_steps}); "
                              "lower it or leave it null for the automatic choice")
        return cfg.warmup_steps
    auto = max(max_steps // 100, min(100, max_steps // 10))
    return min(max(auto, 1), max_steps - 1)


def _check(step: int, cfg: OptimConfig) -> None:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={cfg.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.min_lr_ratio} must lie in [0, 1]")
    if not 0.0 <= cfg.wsd_decay_fraction <= 1.0:
        raise ConfigError(f"optim.wsd_decay_fraction={cfg.wsd_decay_fraction} must lie in [0, 1]")


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based) in a run of `max_steps` steps.

    Example: cfg = OptimConfig(lr=1e-3, warmup_steps=10); lr_at(0, cfg, 100) == 0.0; lr_at(10, cfg, 100) == 1e-3;
    lr_at(100, cfg, 100) == 1e-4 (cosine floor, min_lr_ratio 0.1).
    """
    _check(step, cfg)
    peak = cfg.lr
    floor = cfg.min_lr_ratio * peak
    total = max_steps
    warm = warmup_steps_for(cfg, max_steps)
    t = min(step, total)
    if t < warm:
        return peak * t / warm
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        progress = (t - warm) / (total - warm)  # in [0, 1]; total > warm is guaranteed by warmup_steps_for
        return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
    decay_start = max(warm, total - round(cfg.wsd_decay_fraction * total))
    if t <= decay_start:
        return peak
    progress = (t - decay_start) / (total - decay_start)
    return floor + (peak - floor) * (1.0 - math.sqrt(progress))


def mtp_lambda_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Weight λ of the MTP loss at `step`: cfg.mtp_lambda before step cfg.mtp_lambda_switch·max_steps, then
    cfg.mtp_lambda_late (DeepSeek-V3 section 4.2: 0.3 for the first 10T tokens, 0.1 after; architecture.md section 10).

    Example: defaults, max_steps=1000: mtp_lambda_at(699, cfg, 1000) == 0.3; mtp_lambda_at(700, cfg, 1000) == 0.1.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not 0.0 <= cfg.mtp_lambda_switch <= 1.0:
        raise ConfigError(f"optim.mtp_lambda_switch={cfg.mtp_lambda_switch} must lie in [0, 1]")
    return cfg.mtp_lambda if step < cfg.mtp_lambda_switch * max_steps else cfg.mtp_lambda_late
