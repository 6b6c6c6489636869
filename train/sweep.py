"""`k3 sweep`: a grid of `k3 pretrain` runs over model sizes x tokens per parameter, for `k3 scaling-fit`.

Plan (Hoffmann et al. 2022, arXiv 2203.15556, approach 3 needs runs spread over N and D):
1. The base model is the pretrain preset's model after the user's `--set` overrides. Every size is derived from it
   by `derive_model`, which keeps the K3 shape (architecture.md sections 1-2):
   - MLA at the 1-based layers that are multiples of 4, plus the last layer when the depth is not a multiple of 4
     (K3 itself: 4, 8, ..., 92 and 93): ceil(L/4) MLA layers, so every model has one and deep ones are ~3:1 KDA:MLA
     (shallow ones cannot be: L = 2 is one KDA and one MLA layer);
   - layer 0 (0-based) KDA with the dense MLP (first_k_dense = 1), every other layer a LatentMoE;
   - AttnRes block size B = ceil(L / 8), so the stack has at most and about 8 blocks (AttnRes paper, spec section 2);
   - latent width l = d/2; head dims (KDA d_k, MLA qk_nope / qk_rope / v) kept; head counts, q/kv LoRA ranks,
     expert width m and dense width scaled with d (ranks and widths rounded to multiples of 8, at least 8);
   - experts E, top-K, shared experts, vocab, activation, MTP and every other field kept.
2. The family searched for each target size N*: depth L in [2, 64] x width d = k * step (step = the KDA head dim,
   made even so l = d/2 is whole; k in [1, 256]). N is `count_parameters` of a meta-device model (no memory):
   active non-embedding parameters by default (`params="total"`: total non-embedding), the N `k3 scaling-fit` reads.
   Choice: among the configs with |N/N* - 1| <= tol (default 10%), the one whose aspect ratio d/L is closest (in log)
   to the base model's; when none is that close, the config with the closest N.
3. Tokens D = R * N for each tokens-per-parameter ratio R (N the derived model's own count, not the target), and
   train.max_steps = ceil(D / tokens_per_step), tokens_per_step = batch_size * grad_accum * seq_len; the run trains
   max_steps * tokens_per_step >= D tokens and runs.csv records the tokens actually trained.
4. Runs go to OUT/runs/<size>-<ratio>/ one after another: a finished run (final/ and stats.final_val_loss) is
   skipped, a run with a training checkpoint is resumed, anything else starts fresh. A run whose saved config
   differs from the planned one is an error (never mixed silently). OUT/runs.csv (N, D, loss, C = 6 N D, ...) is
   rewritten after every finished run, so an interrupted sweep still leaves a table `k3 scaling-fit` reads.

k3.train may not import k3.cli, so the caller passes `resolve(sets) -> K3Config` (the pretrain preset plus a list of
`--set` strings); the printed `k3 pretrain` commands carry exactly those strings, so a dry run's commands train the
same models.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import math
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from k3.model.config import ConfigError, ModelConfig, config_to_dict
from k3.model.transformer import K3Model, count_parameters

PARAMS_MODES = {"active": "active_nonembed", "total": "total_nonembed"}  # --params -> count_parameters key
# fields the K3-shape rule sets per size: a --set of one of them would be overwritten, so it is refused
RULE_FIELDS = ("full_attn_layers", "attn_res_block_size", "moe_latent_size", "first_k_dense")
# fields written as --set for every run (all fields derive_model changes)
DERIVED_FIELDS = ("name", "n_layers", "d_model", "full_attn_layers", "attn_res_block_size", "first_k_dense",
                  "kda_num_heads", "mla_num_heads", "q_lora_rank", "kv_lora_rank", "moe_latent_size",
                  "moe_intermediate_size", "dense_intermediate_size")
MIN_LAYERS, MAX_LAYERS, MAX_WIDTH_STEPS = 2, 64, 256
CSV_COLUMNS = ("N", "D", "loss", "C", "size", "tokens_per_param", "params_mode", "n_params_active_nonembed",
               "n_params_total_nonembed", "n_layers", "d_model", "steps", "run_dir")
_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


class SweepError(ConfigError):
    """Bad sweep input or state (sizes, ratios, --set, a run directory); the message names the problem and fix.

    A ConfigError, so `k3` prints it as `error: ...` with exit code 2 like every other input error."""


# ---------------------------------------------------------------------------------------------------- parsing


def parse_size(text: str) -> float:
    """'50k' -> 5e4, '1.5M' -> 1.5e6, '2e5' -> 2e5 (suffixes k, M, B/G, T, any case). SweepError if not > 0."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]?)\s*", text)
    if not m or m.group(2).lower() not in _SUFFIX:
        raise SweepError(f"--sizes: {text!r} is not a size; write a number with an optional suffix k, M, B or T, "
                         "e.g. 50k or 1.5M")
    v = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if not math.isfinite(v) or v <= 0:
        raise SweepError(f"--sizes: {text!r} must be a positive number of parameters")
    return v


def parse_list(text: str, what: str, parse: Callable[[str], float]) -> list[float]:
    """Comma-separated values, parsed and checked for repeats: parse_list('1,2', '--tokens-per-param', float)."""
    items = [t for t in (s.strip() for s in text.split(",")) if t]
    if not items:
        raise SweepError(f"{what}: no values in {text!r}; give a comma-separated list, e.g. {what} 1,2,4")
    vals = [parse(t) for t in items]
    if len(set(vals)) != len(vals):
        raise SweepError(f"{what}: repeated value in {text!r}; list each value once")
    return vals


def parse_ratio(text: str) -> float:
    """A tokens-per-parameter ratio: a positive float ('20', '0.5')."""
    try:
        v = float(text)
    except ValueError:
        raise SweepError(f"--tokens-per-param: {text!r} is not a number; e.g. --tokens-per-param 5,10,20") from None
    if not math.isfinite(v) or v <= 0:
        raise SweepError(f"--tokens-per-param: {text!r} must be a positive number of tokens per parameter")
    return v


def format_size(n: float) -> str:
    """5e4 -> '50k', 1.5e6 -> '1.5M' (the run directory label)."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:.4g}"


# ---------------------------------------------------------------------------------------------------- shapes


def mla_layout(n_layers: int) -> list[int]:
    """1-based MLA layers: multiples of 4, plus the last layer when n_layers % 4 != 0 (K3: 4, ..., 92, 93)."""
    layers = list(range(4, n_layers + 1, 4))
    if n_layers % 4:
        layers.append(n_layers)
    return layers


def _round8(x: float) -> int:
    return max(8, 8 * round(x / 8))


def width_step(base: ModelConfig) -> int:
    """Widths searched are multiples of the KDA head dim (made even so that l = d/2 is whole)."""
    return base.kda_head_dim if base.kda_head_dim % 2 == 0 else 2 * base.kda_head_dim


def derive_model(base: ModelConfig, n_layers: int, d_model: int) -> ModelConfig:
    """The base model resized to depth `n_layers` and width `d_model`, keeping the K3 shape (module docstring).

    Example: derive_model(load_model_config("k3-debug"), 6, 96).full_attn_layers == [4, 6]
    """
    if n_layers < MIN_LAYERS or d_model % 2:
        raise SweepError(f"derive_model: need n_layers >= {MIN_LAYERS} and an even d_model, got {n_layers}, {d_model}")
    s = d_model / base.d_model
    cfg = dataclasses.replace(
        base, name=f"{base.name}-L{n_layers}-d{d_model}", n_layers=n_layers, d_model=d_model,
        full_attn_layers=mla_layout(n_layers), attn_res_block_size=math.ceil(n_layers / 8), first_k_dense=1,
        kda_num_heads=max(1, round(base.kda_num_heads * s)), mla_num_heads=max(1, round(base.mla_num_heads * s)),
        q_lora_rank=_round8(base.q_lora_rank * s), kv_lora_rank=_round8(base.kv_lora_rank * s),
        moe_latent_size=d_model // 2, moe_intermediate_size=_round8(base.moe_intermediate_size * s),
        dense_intermediate_size=_round8(base.dense_intermediate_size * s))
    return cfg.validate()


def count_model(cfg: ModelConfig) -> dict[str, int]:
    """`count_parameters` of `cfg` built on the meta device (shapes only, no memory, ~4 ms per layer)."""
    with torch.device("meta"):
        model = K3Model(cfg)
    return count_parameters(model)


def per_layer_counts(base: ModelConfig, d_model: int, key: str) -> tuple[int, int, int]:
    """N(L) = c0 + (L - 1 - n_mla) * kda_moe + n_mla * mla_moe at width d (c0: embeddings excluded, layer 0 and
    the output norms; AttnRes adds the same per-layer parameters whatever B is). Solved from three meta models."""
    n4 = count_model(derive_model(base, 4, d_model))[key]  # c0 + 2 kda_moe + 1 mla_moe
    n5 = count_model(dataclasses.replace(derive_model(base, 5, d_model), full_attn_layers=[4]))[key]  # + kda_moe
    n4b = count_model(dataclasses.replace(derive_model(base, 4, d_model), full_attn_layers=[3, 4]))[key]
    kda_moe = n5 - n4
    mla_moe = n4b - n4 + kda_moe
    return n4 - 2 * kda_moe - mla_moe, kda_moe, mla_moe


def estimate_n(c0: int, kda_moe: int, mla_moe: int, n_layers: int) -> int:
    """Parameter count of depth n_layers from `per_layer_counts` (the K3 layout of `mla_layout`)."""
    n_mla = len(mla_layout(n_layers))
    return c0 + (n_layers - 1 - n_mla) * kda_moe + n_mla * mla_moe


@dataclass
class SizedModel:
    """A derived model for one target size: N = counts[PARAMS_MODES[params]] of the built model."""

    target: float
    model: ModelConfig
    counts: dict[str, int]
    N: int

    @property
    def rel_err(self) -> float:
        return self.N / self.target - 1.0


def size_model(base: ModelConfig, target: float, *, params: str = "active", tol: float = 0.10) -> SizedModel:
    """Search depth x width for the K3-shaped model whose N is closest to `target` (rule: module docstring, 2).

    Example: size_model(load_model_config("k3-debug"), 5e4).N  # 50,835: L=4, d=32
    """
    if params not in PARAMS_MODES:
        raise SweepError(f"--params must be 'active' or 'total', got {params!r}")
    key, step = PARAMS_MODES[params], width_step(base)
    aspect0 = base.d_model / base.n_layers
    band = math.log1p(tol)
    cands = []  # (within tol?, aspect distance, size distance, L, d)
    smallest = largest = None
    for k in range(1, MAX_WIDTH_STEPS + 1):
        d = k * step
        c0, kda_moe, mla_moe = per_layer_counts(base, d, key)
        ns = [(L, estimate_n(c0, kda_moe, mla_moe, L)) for L in range(MIN_LAYERS, MAX_LAYERS + 1)]
        smallest = ns[0][1] if smallest is None else smallest
        largest = ns[-1][1]
        for L, n in ns:
            dist = abs(math.log(n / target))
            cands.append((dist > band, abs(math.log(d / L / aspect0)) if dist <= band else 0.0, dist, L, d))
        if ns[0][1] > target * (1 + tol) ** 2:  # wider models only grow further from the target
            break
    else:
        if target > largest * (1 + tol) ** 2:
            raise SweepError(f"size {format_size(target)} is above the largest model searched "
                             f"(d={MAX_WIDTH_STEPS * step}, {MAX_LAYERS} layers: N = {largest:,}); use a larger "
                             "base preset")
    if target < smallest / (1 + tol) ** 2:
        raise SweepError(f"size {format_size(target)} is below the smallest model of this family ({MIN_LAYERS} "
                         f"layers, d={step}: {params} non-embedding N = {smallest:,}); use sizes >= "
                         f"{format_size(smallest)}")
    _, _, _, L, d = min(cands)
    model = derive_model(base, L, d)
    counts = count_model(model)
    return SizedModel(target, model, counts, counts[key])


# ---------------------------------------------------------------------------------------------------- plan


@dataclass
class GridPoint:
    """One run of the sweep: a derived model trained for max_steps on the ratio's token budget."""

    size_label: str
    ratio: float
    sized: SizedModel
    tokens_target: int  # D = ratio * N
    tokens_per_step: int
    max_steps: int
    run_dir: Path
    sets: list[str]  # the --set strings of the equivalent `k3 pretrain` command (user's first)

    @property
    def name(self) -> str:
        return self.run_dir.name


@dataclass
class SweepPlan:
    preset: str
    params: str
    out: Path
    points: list[GridPoint]


def _set_value(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(v)


def check_user_sets(sets: list[str]) -> None:
    """Refuse --set of fields the sweep decides per run (they would be silently overwritten)."""
    for s in sets:
        key = s.split("=", 1)[0].strip()
        if key == "train.max_steps":
            raise SweepError("--set train.max_steps: k3 sweep sets max_steps per run from --tokens-per-param "
                             "(ceil(ratio * N / tokens_per_step)); change the ratios instead")
        if key.startswith("model.") and key[6:] in RULE_FIELDS:
            raise SweepError(f"--set {key}: k3 sweep sets this field per size to keep the K3 shape (see "
                             f"`k3 sweep --help`); fields it scales from the base model can be set, e.g. "
                             f"model.moe_intermediate_size")


def plan_sweep(resolve: Callable[[list[str]], Any], *, preset: str, sizes: list[float], ratios: list[float],
               sets: list[str], out: str | Path, params: str = "active", tol: float = 0.10) -> SweepPlan:
    """Derive the model for each size and the step count for each (size, ratio); nothing is run or written.

    resolve(sets) -> K3Config is the pretrain preset with `sets` applied (k3.cli passes resolve_config).
    """
    if not sizes or not ratios:
        raise SweepError("give at least one size (--sizes) and one ratio (--tokens-per-param)")
    check_user_sets(sets)
    base_cfg = resolve(list(sets))
    if base_cfg.model is None or base_cfg.train is None or base_cfg.data is None:
        raise SweepError(f"preset {preset!r} has no model/train/data section; use a pretrain preset")
    tcfg = base_cfg.train
    tokens_per_step = tcfg.batch_size * tcfg.grad_accum * base_cfg.data.seq_len
    sized = [size_model(base_cfg.model, s, params=params, tol=tol) for s in sorted(sizes)]
    for a, b in itertools.pairwise(sized):
        if a.model == b.model:
            raise SweepError(f"sizes {format_size(a.target)} and {format_size(b.target)} give the same model "
                             f"(N = {a.N:,}); choose sizes further apart")
    points = []
    for sm in sized:
        label = format_size(sm.target)
        base_name = base_cfg.model.name
        model = dataclasses.replace(sm.model, name=f"{base_name}-sweep-{label}")
        sm = dataclasses.replace(sm, model=model)
        md = model.to_dict()
        model_sets = [f"model.{f}={_set_value(md[f])}" for f in DERIVED_FIELDS]
        for r in sorted(ratios):
            tokens = math.ceil(r * sm.N)
            steps = max(1, math.ceil(tokens / tokens_per_step))
            run_dir = Path(out) / "runs" / f"{label}-{r:g}"
            points.append(GridPoint(label, r, sm, tokens, tokens_per_step, steps, run_dir,
                                    list(sets) + model_sets + [f"train.max_steps={steps}"]))
    return SweepPlan(preset, params, Path(out), points)


def pretrain_command(plan: SweepPlan, p: GridPoint) -> str:
    """The `k3 pretrain` command line that trains grid point p (shell-quoted)."""
    args = ["k3", "pretrain", "--preset", plan.preset]
    for s in p.sets:
        args += ["--set", s]
    args += ["--out", str(p.run_dir)]
    return shlex.join(args)


def plan_table(plan: SweepPlan):
    """A rich Table of the plan: run name, derived depth / width / MLA layer count, N, tokens, steps, compute."""
    from rich.table import Table

    t = Table(title=f"k3 sweep: {len(plan.points)} runs, N = {plan.params} non-embedding parameters")
    for col in ("run", "L", "d", "MLA", "N", "vs target", "D", "steps", "C=6ND"):
        t.add_column(col, justify="right", no_wrap=True)
    for p in plan.points:  # MLA: the number of MLA layers (their indices: mla_layout(L))
        m, D = p.sized.model, p.max_steps * p.tokens_per_step
        t.add_row(p.name, str(m.n_layers), str(m.d_model), str(len(m.full_attn_layers)), f"{p.sized.N:,}",
                  f"{100 * p.sized.rel_err:+.1f}%", format_size(D), str(p.max_steps),
                  f"{6 * p.sized.N * D:.2g}".replace("e+", "e"))
    return t


# ---------------------------------------------------------------------------------------------------- running


def _plain_config(cfg: Any) -> dict:
    """The resolved config as run_config.yaml stores it (None sections dropped, YAML round trip)."""
    return yaml.safe_load(yaml.safe_dump({k: v for k, v in config_to_dict(cfg).items() if v is not None}))


def run_state(run_dir: Path) -> str:
    """'finished' (final/ and stats.final_val_loss), 'interrupted' (a training checkpoint) or 'new'."""
    rc_path = run_dir / "run_config.yaml"
    if rc_path.is_file() and (run_dir / "final" / "config.json").is_file():
        stats = (yaml.safe_load(rc_path.read_text()) or {}).get("stats") or {}
        if stats.get("final_val_loss") is not None:
            return "finished"
    ck = run_dir / "checkpoints"
    if ck.is_dir() and any(c.name.startswith("step-") for c in ck.iterdir()):
        return "interrupted"
    return "new"


def _check_saved_config(run_dir: Path, cfg: Any) -> None:
    rc_path = run_dir / "run_config.yaml"
    if not rc_path.is_file():
        return
    saved = (yaml.safe_load(rc_path.read_text()) or {}).get("config")
    new = _plain_config(cfg)
    if saved != new:
        diff = sorted(f"{s}.{k}" for s in new for k in (new[s] or {})
                      if (saved or {}).get(s, {}).get(k) != new[s][k])
        raise SweepError(f"{run_dir} holds a run with a different config ({', '.join(diff[:6]) or 'sections'}); "
                         f"use another --out, or delete {run_dir} to retrain it")


def csv_row(p: GridPoint, run_dir: Path, params: str) -> dict:
    """One runs.csv row from a finished run directory (N, D, loss read as `k3 scaling-fit` reads the directory)."""
    from k3.train.scaling import read_points

    pts = read_points([str(run_dir)], params)
    stats = (yaml.safe_load((run_dir / "run_config.yaml").read_text()) or {}).get("stats") or {}
    N, D, loss = float(pts.N[0]), float(pts.D[0]), float(pts.loss[0])
    return {"N": int(N), "D": int(D), "loss": f"{loss:.6f}", "C": f"{6 * N * D:.6g}", "size": p.size_label,
            "tokens_per_param": f"{p.ratio:g}", "params_mode": params,
            "n_params_active_nonembed": stats.get("n_params_active_nonembed"),
            "n_params_total_nonembed": stats.get("n_params_total_nonembed"), "n_layers": p.sized.model.n_layers,
            "d_model": p.sized.model.d_model, "steps": stats.get("steps"), "run_dir": str(run_dir)}


def write_runs_csv(rows: list[dict], path: Path) -> None:
    """Write runs.csv atomically (columns CSV_COLUMNS; `k3 scaling-fit` reads N, D, loss, C)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(CSV_COLUMNS))
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


@dataclass
class SweepResult:
    rows: list[dict]  # runs.csv rows of the finished runs
    ran: list[str]  # run names trained (fresh or resumed) by this call
    skipped: list[str]  # run names already finished
    stopped: str | None  # run name stopped by a signal (the sweep stops there), else None
    csv_path: Path
    stop_signal: int | None = None  # the signal that stopped it, else None


def run_sweep(plan: SweepPlan, resolve: Callable[[list[str]], Any], *, env: dict | None = None,
              kernels: dict | None = None, console=None) -> SweepResult:
    """Train the plan's runs one after another (skip finished, resume interrupted) and write OUT/runs.csv.
    env, kernels: the environment and the applied kernel settings, recorded in every run's run_config.yaml.

    A run stopped by SIGINT/SIGTERM (its checkpoint saved by the train loop) stops the sweep; running the same
    command again resumes it. Returns the rows of runs.csv.
    """
    from k3.train.console import make_console
    from k3.train.pretrain import run as pretrain_run

    console = console or make_console()
    plan.out.mkdir(parents=True, exist_ok=True)
    csv_path = plan.out / "runs.csv"
    rows, ran, skipped = [], [], []
    for i, p in enumerate(plan.points, 1):
        cfg = resolve(p.sets)
        if cfg.model != p.sized.model:  # the --set strings must reproduce the derived model exactly
            raise SweepError(f"internal: the --set list of {p.name} does not reproduce its derived model")
        state = run_state(p.run_dir)
        _check_saved_config(p.run_dir, cfg)
        head = f"[bold]\\[{i}/{len(plan.points)}] {p.name}[/]: N={p.sized.N:,}, {p.max_steps} steps"
        if state == "finished":
            console.print(f"{head}: finished, skipped")
            skipped.append(p.name)
        else:
            console.print(f"{head}: {'resuming' if state == 'interrupted' else 'starting'}")
            rc = {"command": "pretrain", "preset": plan.preset, "config": _plain_config(cfg), "kernels": kernels,
                  "env": env or {}, "init": None, "sweep": {"size": p.size_label, "target_N": p.sized.target, "N": p.sized.N,
                                          "params": plan.params, "tokens_per_param": p.ratio,
                                          "tokens_target": p.tokens_target, "command": pretrain_command(plan, p)}}
            res = pretrain_run(cfg, run_dir=p.run_dir, resume=state == "interrupted", run_config=rc, console=console)
            ran.append(p.name)
            if res.final_dir is None:
                console.print(f"sweep stopped in {p.name}; run the same `k3 sweep` command to resume it")
                write_runs_csv(rows, csv_path)
                return SweepResult(rows, ran, skipped, p.name, csv_path, stop_signal=res.stop_signal)
        rows.append(csv_row(p, p.run_dir, plan.params))
        write_runs_csv(rows, csv_path)
    console.print(f"[bold green]sweep done[/]: {len(ran)} trained, {len(skipped)} skipped; wrote {csv_path} "
                  f"(next: k3 scaling-fit {csv_path})")
    return SweepResult(rows, ran, skipped, None, csv_path)
