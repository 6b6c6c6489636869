"""OUT/report.md of `k3 ablate` from the finished runs under OUT (k3.train.ablate's layout): per suite a table of
mean and min-max over seeds of each metric, a verdict line per comparison, the commands and PNG plots.

Metrics read from a run directory (`read_run`):
    val_loss, val_bpb             run_config.yaml stats.final_val_loss / final_val_bpb (the final evaluation)
    tokens_per_s                  median of metrics.jsonl's per-log-step tokens_per_s, the first logged step left out
    router_max_violation, _cv     mean over the second half of the logged steps
    max_attn_logit                max over the logged steps; _after_first: from the second logged step on
    glu_max_abs                   the last line of glu_max.jsonl (the running max |h| over training forwards)
    passkey                       passkey/passkey.json "overall" (mean exact-match accuracy)
    eval_loss                     loss/loss.json "loss" (qat: every release on the parent's first validation windows)
    dispatch_bytes_per_token      2 K l b, b = 2 (bf16), from the recorded model config (per token and MoE layer)
    n_params_active               run_config.yaml stats
    reverse_kl, teacher_nll       opd_eval/opd_eval.json (opd: the release against its seed's teacher on held-out
                                  prompts), with completion_tokens_per_step (opd and sft arms)
    train_tokens_per_step         run_config.yaml stats.tokens / stats.steps (the targets a step trains on)
    wall_time_s                   run_config.yaml stats.wall_time_s
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import yaml

from .ablate_suites import SUITES, AblateError, Comparison, Suite

METRIC_FMT = {"val_loss": ".4f", "eval_loss": ".4f", "val_bpb": ".4f", "tokens_per_s": ",.0f", "router_max_violation": ".3f",
              "router_cv": ".3f", "max_attn_logit": ".2f", "max_attn_logit_after_first": ".2f", "glu_max_abs": ".2f",
              "passkey": ".2f", "dispatch_bytes_per_token": ",.0f", "n_params_active": ",.0f", "reverse_kl": ".4f",
              "teacher_nll": ".4f", "completion_tokens_per_step": ",.0f", "train_tokens_per_step": ",.0f",
              "wall_time_s": ",.0f"}


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def read_run(run_dir: Path) -> dict | None:
    """The metrics of a finished run (module docstring), with its loss / eval / router / logit / GLU curves;
    None when the run has not finished (no final/ or no recorded final validation loss)."""
    rc_path = run_dir / "run_config.yaml"
    if not (rc_path.is_file() and (run_dir / "final" / "config.json").is_file()):
        return None
    rc = yaml.safe_load(rc_path.read_text()) or {}
    stats = rc.get("stats") or {}
    distilled = "teachers" in rc and stats.get("steps") is not None  # k3 distill records no validation loss
    if stats.get("final_val_loss") is None and "quantization_config" not in rc and not distilled:
        return None
    lines = _lines(run_dir / "metrics.jsonl")
    train = [x for x in lines if "loss" in x and "val_loss" not in x]
    evals = [x for x in lines if "val_loss" in x]
    m: dict = {"n_params_active": stats.get("n_params_active")}
    if stats.get("final_val_loss") is not None:
        m["val_loss"] = float(stats["final_val_loss"])
    loss = run_dir / "loss" / "loss.json"
    if loss.is_file():
        m["eval_loss"] = float(json.loads(loss.read_text())["loss"])
    if stats.get("final_val_bpb") is not None:
        m["val_bpb"] = float(stats["final_val_bpb"])
    opd = run_dir / "opd_eval" / "opd_eval.json"
    if opd.is_file():
        res = json.loads(opd.read_text())
        for k in ("reverse_kl", "teacher_nll", "completion_tokens_per_step"):
            if res.get(k) is not None:
                m[k] = float(res[k])
    if stats.get("steps") and stats.get("tokens") is not None:
        m["train_tokens_per_step"] = stats["tokens"] / stats["steps"]
    if stats.get("wall_time_s") is not None:
        m["wall_time_s"] = float(stats["wall_time_s"])
    tps = [x["tokens_per_s"] for x in train[1:] if "tokens_per_s" in x]
    if tps:
        m["tokens_per_s"] = statistics.median(tps)
    half = train[len(train) // 2:]
    for k in ("router_max_violation", "router_cv"):
        vals = [x[k] for x in half if k in x]
        if vals:
            m[k] = sum(vals) / len(vals)
    logits = [x["max_attn_logit"] for x in train if "max_attn_logit" in x]
    if logits:
        m["max_attn_logit"] = max(logits)
        if len(logits) > 1:
            m["max_attn_logit_after_first"] = max(logits[1:])
    glu = _lines(run_dir / "glu_max.jsonl")
    if glu:
        m["glu_max_abs"] = float(glu[-1]["max_abs_h"])
    pk = run_dir / "passkey" / "passkey.json"
    passkey = json.loads(pk.read_text()) if pk.is_file() else None
    if passkey is not None:
        m["passkey"] = float(passkey["overall"])
    model = (rc.get("config") or {}).get("model") or {}
    if model.get("num_experts_per_tok") and model.get("moe_latent_size"):
        m["dispatch_bytes_per_token"] = 2 * model["num_experts_per_tok"] * model["moe_latent_size"] * 2
    return {"metrics": m, "train": train, "evals": evals, "glu": glu, "passkey": passkey, "rc": rc}


def _mean_range(vals: list[float]) -> tuple[float, float, float]:
    return sum(vals) / len(vals), min(vals), max(vals)


def _fmt(v: float, metric: str) -> str:
    return format(v, METRIC_FMT.get(metric, ".4g"))


def cell(vals: list[float], metric: str) -> str:
    """'2.3456 [2.3400, 2.3500]' (mean [min, max] over seeds); one seed: the value alone; none: '-'."""
    if not vals:
        return "-"
    mean, lo, hi = _mean_range(vals)
    if len(vals) == 1:
        return _fmt(mean, metric)
    return f"{_fmt(mean, metric)} [{_fmt(lo, metric)}, {_fmt(hi, metric)}]"


def _exceeded(c: Comparison, runs: dict[str, dict[int, dict]], params: dict) -> bool:
    """Whether every finished run of c.treatment has c.metric above the bound (False when none is finished)."""
    vals = [r["metrics"][c.metric] for r in runs.get(c.treatment, {}).values() if c.metric in r["metrics"]]
    return bool(vals) and min(vals) > float(params[c.bound])


def verdict(c: Comparison, runs: dict[str, dict[int, dict]], suite: Suite, params: dict) -> str:
    """One verdict line: the claim, yes / no / not tested, and the paired delta (mean +- sample std over seeds).
    params: the scale's fields as OUT/ablate.json recorded them (bounds such as qk_tau)."""
    treat = runs.get(c.treatment, {})
    if c.kind in ("at_most", "exceeds"):
        vals = [r["metrics"][c.metric] for r in treat.values() if c.metric in r["metrics"]]
        bound = float(params[c.bound])
        if not vals:
            return f"- {c.claim}: **not tested** (no finished run of {c.treatment} records {c.metric})"
        if c.kind == "at_most":
            ok = max(vals) <= bound * (1 + c.tol)
            tail = (f"max {c.metric} {max(vals):.2f} over {len(vals)} seed(s) vs tau {bound:g} (allowed "
                    f"{bound * (1 + c.tol):.2f})")
            pre = [x for x in suite.comparisons if x.kind == "exceeds" and x.treatment == c.precondition]
            if pre and not _exceeded(pre[0], runs, params):
                return (f"- {c.claim}: **not tested**: {c.precondition} did not exceed tau, so the clip was not "
                        f"forced; {tail}")
            return f"- {c.claim}: **{'yes' if ok else 'no'}**, {tail}"
        ok = min(vals) > bound
        return (f"- {c.claim}: **{'yes' if ok else 'no'}**, min over seeds of {c.metric} {min(vals):.2f} vs tau "
                f"{bound:g}" + ("" if ok else " (the clip criterion is then not exercised)"))
    base = runs.get(c.baseline, {})
    if c.kind == "recovered":
        ref = runs.get(c.reference, {})
        seeds = sorted(s for s in set(treat) & set(base) & set(ref)
                       if all(c.metric in x[s]["metrics"] for x in (treat, base, ref)))
        if not seeds:
            return (f"- {c.claim}: **not tested** (no seed with finished {c.treatment}, {c.baseline} and "
                    f"{c.reference} runs recording {c.metric})")
        fr, gaps = [], []
        for s in seeds:
            t, b, r0 = (x[s]["metrics"][c.metric] for x in (treat, base, ref))
            gaps.append(b - r0)
            fr.append((b - t) / (b - r0) if b != r0 else math.nan)
        if any(math.isnan(f) for f in fr) or sum(gaps) / len(gaps) < c.tol:
            return (f"- {c.claim}: **not tested**: {c.baseline} loses {_delta(sum(gaps) / len(gaps))} against "
                    f"{c.reference}, less than the {c.tol:g} a fraction needs")
        mean = sum(fr) / len(fr)
        spread = f" +- {_delta(statistics.stdev(fr))} (sample std over {len(fr)} seeds)" if len(fr) > 1 else " (1 seed)"
        return (f"- {c.claim}: **{'yes' if mean > 0 else 'no'}**, recovered fraction ({c.baseline} - {c.treatment}) "
                f"/ ({c.baseline} - {c.reference}) of {c.metric} = {_delta(mean)}{spread}; {c.baseline}'s gap "
                f"{_delta(sum(gaps) / len(gaps))}; criterion fraction > 0")
    seeds = sorted(s for s in set(treat) & set(base)
                   if c.metric in treat[s]["metrics"] and c.metric in base[s]["metrics"])
    if not seeds:
        return f"- {c.claim}: **not tested** (no seed with finished {c.treatment} and {c.baseline} runs " \
               f"recording {c.metric})"
    deltas = [treat[s]["metrics"][c.metric] - base[s]["metrics"][c.metric] for s in seeds]
    mean = sum(deltas) / len(deltas)
    std = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
    ok = {"lower": mean < 0, "higher": mean > 0, "not_worse": mean <= c.tol}[c.kind]
    crit = {"lower": "delta < 0", "higher": "delta > 0", "not_worse": f"delta <= {c.tol:g}"}[c.kind]
    spread = f"+- {_delta(std)} (sample std over {len(seeds)} seeds)" if len(seeds) > 1 else "(1 seed)"
    return (f"- {c.claim}: **{'yes' if ok else 'no'}**, {c.metric} {c.treatment} - {c.baseline} = "
            f"{'+' if mean >= 0 else ''}{_delta(mean)} {spread}; criterion {crit}")


def _delta(x: float) -> str:
    """A paired difference: 4 significant digits (a delta is often far smaller than the metric itself)."""
    return f"{x:.4g}"


# ---------------------------------------------------------------------------------------------------- plots


def _figure(n: int = 1, width: float = 6.4):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * n, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, n, squeeze=False)[0]


def _colors(labels: list[str]) -> dict[str, str]:
    return {lab: f"C{i % 10}" for i, lab in enumerate(labels)}


def _curves(ax, runs, arms, key: str, source: str = "train") -> bool:
    col, any_line = _colors(arms), False
    for arm in arms:
        for s, r in sorted(runs.get(arm, {}).items()):
            pts = [(x["step"], x[key]) for x in r[source] if key in x and "step" in x]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, color=col[arm], lw=1.2, alpha=0.85, label=arm if s == min(runs[arm]) else None)
                any_line = True
    return any_line


def plot_suite(suite: Suite, runs: dict, out_dir: Path, params: dict) -> list[Path]:
    """The suite's PNGs in out_dir (loss; glu, router, logit, passkey where the suite has them)."""
    arms, made = [a.label for a in suite.arms], []
    out_dir.mkdir(parents=True, exist_ok=True)

    def save(fig, name):
        p = out_dir / name
        fig.savefig(p, dpi=100)
        made.append(p)

    if "loss" in suite.plots:
        fig, (a1, a2) = _figure(2)
        if _curves(a1, runs, arms, "loss") | _curves(a2, runs, arms, "val_loss", "evals"):
            a1.set(xlabel="step", ylabel="train loss (nats/token)", title=f"{suite.name}: training loss")
            a2.set(xlabel="step", ylabel="val loss", title=f"{suite.name}: validation loss")
            for ax in (a1, a2):
                ax.legend(fontsize=8)
                ax.grid(alpha=0.3)
            save(fig, "loss.png")
    if "opd" in suite.plots:
        fig, (a1, a2) = _figure(2)
        ce = [a for a in arms if a != "opd"]
        if _curves(a1, runs, ce, "loss") | _curves(a2, runs, ["opd"], "reverse_kl"):
            a1.set(xlabel="step", ylabel="train CE (nats/token)", title=f"{suite.name}: pretrain and SFT loss")
            a2.set(xlabel="step", ylabel="KL(student || teacher) per completion token",
                   title=f"{suite.name}: OPD's reverse KL on its samples")
            for ax in (a1, a2):
                ax.legend(fontsize=8)
                ax.grid(alpha=0.3)
            save(fig, "opd.png")
    if "glu" in suite.plots:
        fig, (ax,) = _figure()
        if _curves(ax, runs, arms, "max_abs_h", "glu"):
            ax.axhline(100.0, color="k", ls="--", lw=0.8, label="C2-GLU bound 100")
            ax.set(xlabel="step", ylabel="running max |h|", yscale="log", title=f"{suite.name}: GLU intermediate max")
            ax.legend(fontsize=8)
            save(fig, "glu_max.png")
    if "router" in suite.plots:
        fig, (a1, a2) = _figure(2)
        if _curves(a1, runs, arms, "router_max_violation") | _curves(a2, runs, arms, "router_cv"):
            a1.set(xlabel="step", ylabel="max load / mean - 1 (max over layers)", title="router max violation")
            a2.set(xlabel="step", ylabel="load CV (mean over layers)", title="router load CV")
            for ax in (a1, a2):
                ax.legend(fontsize=8)
                ax.grid(alpha=0.3)
            save(fig, "router.png")
    if "logit" in suite.plots:
        fig, (ax,) = _figure()
        if _curves(ax, runs, arms, "max_attn_logit"):
            tau = float(params["qk_tau"])
            ax.axhline(tau, color="k", ls="--", lw=0.8, label=f"tau {tau:g}")
            ax.set(xlabel="step", ylabel="max MLA logit", yscale="log", title=f"{suite.name}: max attention logit")
            ax.legend(fontsize=8)
            save(fig, "max_logit.png")
    if "passkey" in suite.plots:
        from .evaluate import plot_passkey

        for arm in arms:
            for s, r in sorted(runs.get(arm, {}).items()):
                if r["passkey"] is not None:
                    p = out_dir / f"passkey-{arm}-seed-{s}.png"
                    plot_passkey(r["passkey"], p, f"passkey: {suite.name}/{arm} seed {s}")
                    made.append(p)
    return made


# ---------------------------------------------------------------------------------------------------- report


def write_report(out: str | Path) -> Path:
    """Read OUT/ablate.json's planned runs, the finished ones among them, and write OUT/report.md and the plots
    (OUT/plots/SUITE/*.png). Runs that are planned but not finished are listed as missing."""
    out = Path(out)
    plan_path = out / "ablate.json"
    if not plan_path.is_file():
        raise AblateError(f"{plan_path} not found: {out} is not a k3 ablate directory (run k3 ablate SUITE --out "
                          f"{out} first)")
    plan = json.loads(plan_path.read_text())["suites"]
    lines = ["# k3 ablate report", "",
             ("Each table: mean over seeds, [min, max] when there are several. Verdicts compare arms paired by "
              "seed (delta = treatment - baseline; +- is the sample standard deviation of the paired deltas). "
              "Metric definitions: docs/ablate.md."), ""]
    for name in [n for n in SUITES if n in plan]:
        suite, entry = SUITES[name], plan[name]
        scale = entry["scale"]
        runs: dict[str, dict[int, dict]] = {}
        missing = []
        for rname, info in entry["runs"].items():
            r = read_run(out / info["dir"])
            if r is None:
                missing.append((rname, info))
            else:
                runs.setdefault(info["arm"], {})[info["seed"]] = r
        lines += [f"## {suite.claim_no}. {name}: {suite.claim}", "",
                  f"Scale `{scale}`, {entry['seeds']} seed(s). {suite.note}", ""]
        metrics = list(suite.metrics)
        lines.append("| arm | runs | " + " | ".join(metrics) + " |")
        lines.append("|---|---|" + "---|" * len(metrics))
        for arm in suite.arms:
            got = runs.get(arm.label, {})
            cells = [cell([r["metrics"][m] for r in got.values() if r["metrics"].get(m) is not None], m)
                     for m in metrics]
            lines.append(f"| {arm.label} | {len(got)} | " + " | ".join(cells) + " |")
        lines += ["", "Verdicts:", ""] + [verdict(c, runs, suite, entry["scale_params"]) for c in suite.comparisons] + [""]
        if missing:
            lines += ["Missing (not finished, left out of the table and verdicts):", ""]
            lines += [f"- {rname} ({info['dir']})" for rname, info in missing] + [""]
        pngs = plot_suite(suite, runs, out / "plots" / name, entry["scale_params"])
        if pngs:
            lines += [f"![{p.stem}]({p.relative_to(out).as_posix()})" for p in pngs] + [""]
        lines += ["Reproduce:", "", "```", entry["command"], "```", "", "One run alone:", "", "```"]
        lines += [info["command"] for info in entry["runs"].values()] + ["```", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
