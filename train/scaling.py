"""`k3 scaling-fit`: Chinchilla approach-3 fit of L(N, D) = E + A/N^alpha + B/D^beta, planning, bootstrap, report.

The fit follows Hoffmann et al. 2022 (arXiv 2203.15556, section 3.3 and appendix D.2) and the Epoch AI replication
(Besiroglu et al. 2024, arXiv 2404.10102): with a = log A, b = log B, e = log E,

    min over (e, a, b, alpha, beta) of  sum_i Huber_delta( LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i )

Huber_delta(r) = r^2/2 for |r| <= delta, else delta (|r| - delta/2); delta = 1e-3; L-BFGS from every point of the
grid alpha, beta in {0, .5, .., 2}, e in {-1, -.5, .., 1}, a, b in {0, 5, .., 25} (4500 starts); the lowest objective
among the starts that converged is kept, then polished to a stationary point (see REFINE). All starts run as one
batch (`lbfgs_batched`): every start has its own history, step and line search, exactly as if each ran alone, so no
start influences another (a summed objective under torch.optim.LBFGS would couple them through one shared line
search). Converged starts leave the batch.

Compute-optimal allocation under C = 6 N D (Hoffmann et al. eq. 4): N_opt = G (C/6)^a, D_opt = (C/6)^b / G with
G = (alpha A / (beta B))^(1/(alpha+beta)), a = beta/(alpha+beta), b = alpha/(alpha+beta).

Inputs (`read_points`): CSV files with columns N (or params), D (or tokens), loss and optionally C (or flops), any
letter case; and k3 run directories (RUN_DIR/run_config.yaml + RUN_DIR/metrics.jsonl, as `k3 pretrain` writes them):
N = run_config.yaml `stats.n_params_active_nonembed` (`--params total`: `stats.n_params_total_nonembed`), loss = the
last metrics line with `val_loss` (else the last `loss`), D = that line's `tokens` (else `stats.tokens`). A folder
without run_config.yaml is read as a folder of run directories. `--exclude` filters: see EXCLUDE_GRAMMAR.

The optimiser bookkeeping runs in numpy and the objective in torch (vectorised exp/log over [S, P], threaded).
Shape legend: S = starts in the batch, P = data points, K = 5 parameters ordered (e, a, b, alpha, beta),
M = L-BFGS history pairs, R = bootstrap replicas.
"""

from __future__ import annotations

import ast
import csv
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from k3.train.config import ScalingConfig
from k3.train.lbfgs import STATUS, LBFGSResult, lbfgs_batched


class ScalingFitError(ValueError):
    """Bad scaling-fit input (file, column, value, filter); the message names the problem and the fix."""


# objective


def huber_lse_objective(theta_SK: torch.Tensor, logN_P: torch.Tensor, logD_P: torch.Tensor, logL_P: torch.Tensor,
                        delta: float = 1e-3, weight_SP: torch.Tensor | None = None):
    """Per-start Huber objective and its gradient.

    theta_SK: [S, 5] (e, a, b, alpha, beta); logN_P, logD_P, logL_P: [P]; weight_SP: optional [S, P] point weights
    (bootstrap counts). Returns f_S [S] = sum_i w_i Huber(LSE_i - logL_i) and g_SK [S, 5], float64.
    Example: f, g = huber_lse_objective(torch.tensor([[0.5, 6., 6., .3, .3]]), logN, logD, logL)
    """
    e, a, b, alpha, beta = (v[:, None] for v in theta_SK.unbind(1))  # each [S, 1]
    t1_SP = torch.addcmul(a, alpha, logN_P[None], value=-1.0)  # log(A / N^alpha)
    t2_SP = torch.addcmul(b, beta, logD_P[None], value=-1.0)  # log(B / D^beta)
    m_SP = torch.maximum(torch.maximum(t1_SP, t2_SP), e)  # max-shift keeps exp() <= 1 at any trial point
    # clamp: exp() of inputs below ~-708 returns denormals or 0 through a ~10x slower path on x86; e^-600 ~ 1e-261
    # is still a normal float, and changes LSE by < 1e-260
    t1_SP.sub_(m_SP).clamp_(min=-600.0).exp_()
    t2_SP.sub_(m_SP).clamp_(min=-600.0).exp_()
    t3_SP = torch.sub(e, m_SP).clamp_(min=-600.0).exp_()
    s_SP = t1_SP + t2_SP + t3_SP
    r_SP = m_SP.add_(torch.log(s_SP)).sub_(logL_P)  # residual of log-loss, reuses m's memory
    hp_SP = r_SP.clamp(-delta, delta)  # Huber'(r)
    h_SP = (r_SP - 0.5 * hp_SP).mul_(hp_SP)  # = r^2/2 inside [-delta, delta], delta(|r| - delta/2) outside
    if weight_SP is not None:
        h_SP.mul_(weight_SP)
        hp_SP.mul_(weight_SP)
    ones_P = torch.ones_like(logN_P)
    f_S = h_SP @ ones_P  # a matrix-vector product reduces rows faster than .sum(1) on CPU
    q_SP = hp_SP.div_(s_SP)  # Huber' times the softmax normaliser: dLSE/dt_k = exp(t_k - m) / s
    g1_SP, g2_SP, g3_SP = t1_SP.mul_(q_SP), t2_SP.mul_(q_SP), t3_SP.mul_(q_SP)
    g_SK = torch.stack([g3_SP @ ones_P, g1_SP @ ones_P, g2_SP @ ones_P, -(g1_SP @ logN_P), -(g2_SP @ logD_P)], 1)
    return f_S, g_SK


# the fit


@dataclass
class ScalingFit:
    """Fit of L(N, D) = E + A/N^alpha + B/D^beta (the grid's best converged start, polished) and the grid's optima."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float  # sum of Huber losses at the optimum
    n_points: int
    n_starts: int
    n_converged: int
    seconds: float  # wall time of the batched L-BFGS and the polish
    optima_SK: np.ndarray  # [n_converged, 5] converged (e, a, b, alpha, beta) of the grid, lowest objective first
    grid_objective: float  # best objective of the grid search before the polish

    @property
    def a(self) -> float:  # N_opt ~ C^a
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:  # D_opt ~ C^b
        return self.alpha / (self.alpha + self.beta)

    def predict(self, N, D) -> np.ndarray:
        """Fitted loss at N parameters and D tokens (broadcasting arrays)."""
        return self.E + self.A / np.asarray(N, dtype=np.float64) ** self.alpha + self.B / np.asarray(D) ** self.beta


def start_grid(alphas=(0, .5, 1, 1.5, 2), betas=(0, .5, 1, 1.5, 2), es=(-1, -.5, 0, .5, 1),
               as_=(0, 5, 10, 15, 20, 25), bs=(0, 5, 10, 15, 20, 25)) -> np.ndarray:
    """Cartesian grid of starts, [S, 5] float64 in (e, a, b, alpha, beta) order; the defaults give Hoffmann's 4500."""
    grid = np.array(np.meshgrid(es, as_, bs, alphas, betas, indexing="ij"), dtype=np.float64).reshape(5, -1).T
    return np.ascontiguousarray(grid)


def _check_points(N, D, loss) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arrs = [np.asarray(v, dtype=np.float64).reshape(-1) for v in (N, D, loss)]
    if len({a.size for a in arrs}) != 1:
        raise ScalingFitError(f"N, D and loss have different lengths {[a.size for a in arrs]}")
    for name, a in zip(("N", "D", "loss"), arrs):
        bad = np.flatnonzero(~np.isfinite(a) | (a <= 0))
        if bad.size:
            raise ScalingFitError(f"{name} must be finite and > 0; point {bad[0]} has {name} = {a[bad[0]]}")
    if arrs[0].size < 5:
        raise ScalingFitError(f"need at least 5 points to fit the 5 parameters (E, A, B, alpha, beta); got "
                              f"{arrs[0].size}: add runs or loosen --exclude")
    return arrs[0], arrs[1], arrs[2]


def _objective_np(N_P, D_P, loss_P, delta, weight_SP=None):
    """`huber_lse_objective` as fun(x_SK, rows_S) -> (f_S, g_SK) in numpy for `lbfgs_batched`."""
    logN_P, logD_P, logL_P = (torch.from_numpy(np.log(v)) for v in (N_P, D_P, loss_P))

    def fun(x_SK, rows_S):
        w = None if weight_SP is None else weight_SP[torch.from_numpy(rows_S)]
        f, g = huber_lse_objective(torch.from_numpy(x_SK), logN_P, logD_P, logL_P, delta, w)
        return f.numpy(), g.numpy()

    return fun


def _best_per_group(res: LBFGSResult, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Lowest objective in each consecutive group of refined starts: x [G, 5], f [G] (NaN: no finite objective).

    Any status counts: a refinement starts at a converged point and only accepts decreases, so a start that ends on
    a failed line search (no further decrease at machine precision) still holds a valid, lower point."""
    f_GS = np.where(np.isfinite(res.f_S), res.f_S, np.inf).reshape(n_groups, -1)
    i = f_GS.argmin(1)  # ties resolve to the first start in grid order, so the pick is deterministic
    x, f = res.x_SK.reshape(n_groups, -1, 5)[np.arange(n_groups), i], f_GS[np.arange(n_groups), i]
    return np.where(np.isinf(f)[:, None], np.nan, x), np.where(np.isinf(f), np.nan, f)


def distinct_optima(optima_SK: np.ndarray, n: int) -> np.ndarray:
    """The first n rows of optima_SK (sorted best first) that differ in some parameter by >= 1e-4, [<= n, 5]."""
    _, first = np.unique(np.round(optima_SK, 4), axis=0, return_index=True)  # many starts share one optimum
    return optima_SK[np.sort(first)[:n]]


# refinement from a nearby point: stop only at a stationary point or when f no longer decreases. scipy's default
# relative-decrease stop (2.2e-9 absolute while f < 1) ends a start that begins close to an optimum in a flat valley
# after a step or two, far from the optimum (cf. Besiroglu et al. 2024 on early-stopped Chinchilla fits)
REFINE = {"ftol": 0.0, "gtol": 1e-10, "max_iter": 10_000}


def fit_scaling_law(N, D, loss, *, starts_SK: np.ndarray | None = None, delta: float = 1e-3, max_iter: int = 1000,
                    ftol: float = 2.220446049250313e-09, gtol: float = 1e-5, memory: int = 10,
                    polish: int = 8) -> ScalingFit:
    """Chinchilla approach-3 fit (Hoffmann et al. 2022 appendix D.2) from every start at once.

    N, D, loss: [P] arrays (parameters, tokens, loss in nats); starts_SK: [S, 5] (e, a, b, alpha, beta), default
    `start_grid()` (4500 starts). The `polish` lowest distinct converged optima are then refined with REFINE
    tolerances; returns the lowest objective found as a ScalingFit.
    Example: fit = fit_scaling_law(N, D, L); fit.alpha, fit.beta
    """
    N, D, loss = _check_points(N, D, loss)
    starts_SK = start_grid() if starts_SK is None else np.asarray(starts_SK, dtype=np.float64)
    t0 = time.perf_counter()
    res = lbfgs_batched(_objective_np(N, D, loss, delta), starts_SK, memory=memory, max_iter=max_iter, ftol=ftol,
                        gtol=gtol)
    conv = res.converged_S
    if not conv.any():
        raise ScalingFitError(f"none of the {len(starts_SK)} starts converged in {max_iter} iterations; raise "
                              "max_iter or check the data (status counts: "
                              f"{ {STATUS[int(k)]: int((res.status_S == k).sum()) for k in np.unique(res.status_S)} })")
    order = np.argsort(np.where(conv, res.f_S, np.inf), kind="stable")[: int(conv.sum())]
    optima, best, f_best = res.x_SK[order], res.x_SK[order[0]], float(res.f_S[order[0]])
    if polish > 0:
        pol = lbfgs_batched(_objective_np(N, D, loss, delta), distinct_optima(optima, polish), memory=memory, **REFINE)
        x, f = _best_per_group(pol, 1)
        if f[0] <= f_best:  # refinements only move downhill; False for a NaN row
            best, f_best = x[0], float(f[0])
    e, a, b, alpha, beta = best
    return ScalingFit(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=float(alpha), beta=float(beta),
                      objective=f_best, n_points=len(N), n_starts=len(starts_SK), n_converged=int(conv.sum()),
                      seconds=time.perf_counter() - t0, optima_SK=optima, grid_objective=float(res.f_S[order[0]]))


def compute_optimal(E: float, A: float, B: float, alpha: float, beta: float, C) -> dict[str, np.ndarray]:
    """Loss-minimising N and D for compute C = 6 N D (Hoffmann et al. 2022 eq. 4), elementwise over C [...].

    Returns {"N_opt", "D_opt", "tokens_per_param", "loss"} arrays shaped like C.
    Example: compute_optimal(1.69, 406.4, 410.7, 0.34, 0.28, 5.76e23)["N_opt"]  # 3.2e10 (Chinchilla's law)
    """
    C = np.asarray(C, dtype=np.float64)
    G = (alpha * A / (beta * B)) ** (1.0 / (alpha + beta))
    N_opt = G * (C / 6.0) ** (beta / (alpha + beta))
    D_opt = (C / 6.0) / N_opt
    loss = E + A / N_opt ** alpha + B / D_opt ** beta
    return {"N_opt": N_opt, "D_opt": D_opt, "tokens_per_param": D_opt / N_opt, "loss": loss}


def bootstrap_fits(N, D, loss, fit: ScalingFit, *, n: int, n_starts: int = 32, seed: int = 0, delta: float = 1e-3,
                   memory: int = 10) -> np.ndarray:
    """Refit n resamples (points drawn with replacement) of the data; returns [n, 5] (E, A, B, alpha, beta).

    Each replica starts from the `n_starts` lowest distinct optima of the full fit (the basins the full grid found)
    instead of all 4500 grid points and refines with REFINE tolerances (they reach the optimum a full-grid refit of
    the replica finds); all replicas x starts run as one batch with per-start point weights (bootstrap counts).
    Replicas without a finite objective are NaN rows.
    Example: samples = bootstrap_fits(N, D, L, fit_scaling_law(N, D, L), n=100); np.percentile(samples, 2.5, 0)
    """
    N, D, loss = _check_points(N, D, loss)
    P = len(N)
    starts = distinct_optima(fit.optima_SK, n_starts)
    K = len(starts)
    counts_RP = np.random.default_rng(seed).multinomial(P, np.full(P, 1.0 / P), size=n).astype(np.float64)
    out, per_chunk = np.full((n, 5), math.nan), max(1, 4500 // K)
    for r0 in range(0, n, per_chunk):
        w_SP = torch.from_numpy(counts_RP[r0:r0 + per_chunk]).repeat_interleave(K, 0)  # [R_chunk * K, P]
        res = lbfgs_batched(_objective_np(N, D, loss, delta, w_SP), np.tile(starts, (len(w_SP) // K, 1)),
                            memory=memory, **REFINE)
        x, _ = _best_per_group(res, len(w_SP) // K)
        out[r0:r0 + len(x)] = np.concatenate([np.exp(x[:, :3]), x[:, 3:]], 1)
    return out


# inputs


@dataclass
class Points:
    """Observed runs: N, D, loss, C [P] float64 arrays."""

    N: np.ndarray
    D: np.ndarray
    loss: np.ndarray
    C: np.ndarray  # the input's C/flops column where given, else 6 N D

    def select(self, keep_P: np.ndarray) -> Points:
        return Points(self.N[keep_P], self.D[keep_P], self.loss[keep_P], self.C[keep_P])


_ALIASES = {"n": "N", "params": "N", "d": "D", "tokens": "D", "loss": "loss", "c": "C", "flops": "C"}
PARAMS_KEYS = {"active": "n_params_active_nonembed", "total": "n_params_total_nonembed"}


def _number(text: str, where: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ScalingFitError(f"{where}: {text!r} is not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise ScalingFitError(f"{where}: value {text!r} must be a finite number > 0 (drop the row or fix the value)")
    return v


def _read_csv(path: Path) -> list[tuple[float, float, float, float | None]]:
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise ScalingFitError(f"{path}: empty file; expected a header with columns N (or params), D (or "
                                  "tokens), loss and optionally C (or flops)")
        cols: dict[str, int] = {}
        for i, name in enumerate(header):
            key = _ALIASES.get(name.strip().lower())
            if key in cols:
                raise ScalingFitError(f"{path}: two columns mean {key} ({header[cols[key]]!r} and {name!r}); keep one")
            if key:
                cols[key] = i
        missing = [k for k in ("N", "D", "loss") if k not in cols]
        if missing:
            raise ScalingFitError(f"{path}: missing column(s) {missing}; found {header}. Expected N (or params), "
                                  "D (or tokens), loss and optionally C (or flops), any letter case")
        rows = []
        for line, rec in enumerate(reader, start=2):
            if not rec or all(not f.strip() for f in rec):
                continue
            where = f"{path}:{line}"
            if len(rec) < len(header):
                raise ScalingFitError(f"{where}: {len(rec)} fields, the header has {len(header)}")
            v = {k: _number(rec[i].strip(), f"{where} column {header[i]!r}") for k, i in cols.items()}
            rows.append((v["N"], v["D"], v["loss"], v.get("C")))
    if not rows:
        raise ScalingFitError(f"{path}: no data rows under the header")
    return rows


def _read_run(run_dir: Path, params: str) -> tuple[float, float, float, None]:
    """One k3 run directory: N from run_config.yaml `stats`, loss and D from the last eval line of metrics.jsonl."""
    cfg_path, met_path = run_dir / "run_config.yaml", run_dir / "metrics.jsonl"
    for p in (cfg_path, met_path):
        if not p.is_file():
            raise ScalingFitError(f"{run_dir}: no {p.name}; a run directory written by `k3 pretrain` has "
                                  "run_config.yaml and metrics.jsonl")
    stats = (yaml.safe_load(cfg_path.read_text()) or {}).get("stats") or {}
    key = PARAMS_KEYS[params]
    if key not in stats:
        raise ScalingFitError(f"{cfg_path}: no stats.{key} (N for --params {params}); found stats keys "
                              f"{sorted(stats)}")
    val_line, loss_line = None, None
    for i, text in enumerate(met_path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScalingFitError(f"{met_path}:{i}: not JSON ({e.msg})") from None
        if rec.get("val_loss") is not None:
            val_line = (rec, i, "val_loss")
        if rec.get("loss") is not None:
            loss_line = (rec, i, "loss")
    if val_line is None and loss_line is None:
        raise ScalingFitError(f"{met_path}: no line with val_loss or loss; did the run log any step?")
    rec, i, lkey = val_line or loss_line
    where = f"{met_path}:{i}"
    tokens = rec.get("tokens", stats.get("tokens"))
    if tokens is None:
        raise ScalingFitError(f"{where}: no `tokens` on the line and no stats.tokens in {cfg_path.name}")
    return (_number(str(stats[key]), f"{cfg_path} stats.{key}"), _number(str(tokens), f"{where} tokens"),
            _number(str(rec[lkey]), f"{where} {lkey}"), None)


def read_points(inputs: list[str], params: str = "active") -> Points:
    """Read CSV files and k3 run directories (a directory without run_config.yaml: each run below it).

    Example: pts = read_points(["runs.csv", "runs/"]); pts.N, pts.D, pts.loss
    """
    if params not in PARAMS_KEYS:
        raise ScalingFitError(f"--params must be 'active' or 'total', got {params!r}")
    if not inputs:
        raise ScalingFitError("no input: pass CSV files and/or k3 run directories")
    rows = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            rows += _read_csv(path)
        elif path.is_dir():
            runs = [path] if (path / "run_config.yaml").exists() else sorted(
                p for p in path.iterdir() if (p / "run_config.yaml").is_file())
            if not runs:
                raise ScalingFitError(f"{path}: neither a run directory (run_config.yaml) nor a folder of runs")
            rows += [_read_run(r, params) for r in runs]
        else:
            raise ScalingFitError(f"{path}: no such file or directory")
    N, D, loss = (np.array([r[k] for r in rows]) for k in range(3))
    C = np.array([6.0 * n * d if r[3] is None else r[3] for r, n, d in zip(rows, N, D)])
    return Points(N, D, loss, C)


# --exclude expressions

EXCLUDE_GRAMMAR = ("a comparison of N, D, C or loss with numbers (< <= > >= == !=, chains like 1e7 < N < 1e8), "
                   "combined with and, or, not and parentheses; names are case-insensitive (params, tokens, flops "
                   "also work); e.g. \"N < 1e7 or loss > 5\"")
_OPS = {ast.Lt: np.less, ast.LtE: np.less_equal, ast.Gt: np.greater, ast.GtE: np.greater_equal, ast.Eq: np.equal,
        ast.NotEq: np.not_equal}


def parse_exclude(expr: str) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    """Compile a filter such as "N<1e7 or loss>5" into mask(columns) -> bool [P] (the points to drop).

    The text is parsed with `ast` and only the node types of EXCLUDE_GRAMMAR are accepted, so nothing is evaluated
    as code. Example: parse_exclude("N < 1e7")({"N": np.array([1e6, 1e8])}) -> array([True, False])
    """
    try:
        tree = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError:
        raise ScalingFitError(f"--exclude {expr!r} is not a valid filter: use {EXCLUDE_GRAMMAR}") from None

    def build(node):
        if isinstance(node, ast.BoolOp):
            parts, red = [build(v) for v in node.values], (np.logical_and if isinstance(node.op, ast.And)
                                                           else np.logical_or)
            return lambda cols: red.reduce([p(cols) for p in parts])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            inner = build(node.operand)
            return lambda cols: ~inner(cols)
        if isinstance(node, ast.Compare) and all(type(op) in _OPS for op in node.ops):
            vals = [value(v) for v in (node.left, *node.comparators)]
            if all(isinstance(v, float) for v in vals):
                raise ScalingFitError(f"--exclude {expr!r}: a comparison must involve N, D, C or loss")
            ops = [_OPS[type(op)] for op in node.ops]
            get = [(lambda cols, v=v: cols[v]) if isinstance(v, str) else (lambda cols, v=v: v) for v in vals]
            return lambda cols: np.logical_and.reduce([op(get[j](cols), get[j + 1](cols)) for j, op in enumerate(ops)])
        raise ScalingFitError(f"--exclude {expr!r}: {ast.unparse(node)!r} is not allowed; use {EXCLUDE_GRAMMAR}")

    def value(node):
        if isinstance(node, ast.Name) and node.id.lower() in _ALIASES:
            return _ALIASES[node.id.lower()]
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            return -float(value(node.operand))
        raise ScalingFitError(f"--exclude {expr!r}: {ast.unparse(node)!r} is neither N, D, C, loss nor a number")

    mask = build(tree)
    return lambda cols: np.broadcast_to(mask(cols), np.shape(cols["N"])).copy()


# plot, report, entry point


def plot_fit(pts: Points, fit: ScalingFit, budgets: list[float], path: Path) -> None:
    """fit.png: loss vs compute with the fitted frontier; iso-FLOP curves vs N; loss vs N at fixed D (Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_c, ax_iso, ax_d = fig.subplots(1, 3)
    c_lo, c_hi = pts.C.min(), max(pts.C.max(), *budgets) if budgets else pts.C.max()
    C_grid = np.logspace(np.log10(c_lo) - 0.3, np.log10(c_hi) + 0.3, 200)
    front = compute_optimal(fit.E, fit.A, fit.B, fit.alpha, fit.beta, C_grid)
    sc = ax_c.scatter(pts.C, pts.loss, c=np.log10(pts.N), cmap="viridis", s=18, label="runs")
    fig.colorbar(sc, ax=ax_c, label="log10 N")
    ax_c.plot(C_grid, front["loss"], "k--", label="compute-optimal frontier")
    if budgets:
        opt = compute_optimal(fit.E, fit.A, fit.B, fit.alpha, fit.beta, budgets)
        ax_c.scatter(budgets, opt["loss"], marker="*", s=160, c="red", zorder=3, label="--budget")
    ax_c.set(xscale="log", xlabel="compute C (FLOPs)", ylabel="loss", title="loss vs compute")
    cmap = sc.get_cmap()

    def color(v, ref):  # the scatter's colour for value v on the log scale of the reference column
        lo, hi = np.log10(ref.min()), np.log10(ref.max())
        return cmap((np.log10(v) - lo) / max(hi - lo, 1e-12))

    logc = np.unique(np.round(np.log10(pts.C), 2))  # an iso-FLOP design has a few distinct budgets: draw those
    levels = 10 ** logc if len(logc) <= 10 else np.logspace(logc[0], logc[-1], 5)
    n_grid = np.logspace(np.log10(pts.N.min()) - 0.5, np.log10(pts.N.max()) + 0.5, 200)
    for c in levels:
        ax_iso.plot(n_grid, fit.predict(n_grid, c / (6 * n_grid)), color=color(c, pts.C), label=f"C = {c:.2g}")
    ax_iso.scatter(pts.N, pts.loss, c=np.log10(pts.C), cmap=cmap, s=14)
    ax_iso.plot(front["N_opt"], front["loss"], "k--", label="N_opt(C)")
    lo, hi = pts.loss.min(), pts.loss.max()
    ax_iso.set(xscale="log", xlabel="N (parameters)", ylabel="loss", title="iso-FLOP curves (C = 6ND) and N_opt",
               ylim=(lo - 0.1 * (hi - lo), hi + 0.1 * (hi - lo)), xlim=(n_grid[0], n_grid[-1]))
    for d in np.unique(np.quantile(pts.D, [0.0, 0.25, 0.5, 0.75, 1.0])):
        ax_d.plot(n_grid, fit.predict(n_grid, d), color=color(d, pts.D), label=f"D = {d:.2g}")
    ax_d.scatter(pts.N, pts.loss, c=np.log10(pts.D), cmap=cmap, s=14)
    ax_d.set(xscale="log", xlabel="N (parameters)", ylabel="loss", title="loss vs N at fixed D (points coloured by D)",
             ylim=ax_iso.get_ylim())
    for ax in (ax_c, ax_iso, ax_d):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"L = {fit.E:.3g} + {fit.A:.4g}/N^{fit.alpha:.3f} + {fit.B:.4g}/D^{fit.beta:.3f}"
                 f"   (a = {fit.a:.3f}, b = {fit.b:.3f}, {fit.n_points} points)")
    fig.savefig(path, dpi=110)


def _interval(samples: np.ndarray, ci: float) -> list[float]:
    ok = samples[np.isfinite(samples)]  # replicas without a converged start are NaN
    return [float(v) for v in np.percentile(ok, [50 * (1 - ci), 50 * (1 + ci)])] if ok.size else [None, None]


def run(cfg: ScalingConfig) -> dict:
    """`k3 scaling-fit`: read inputs, fit, bootstrap, plan the budgets, write DIR/fit.json (+ fit.png), print a table.

    Returns the fit.json dictionary. Bad input raises ScalingFitError.
    Example: run(ScalingConfig(inputs=["runs.csv"], out="fit", budgets=[1e21]))["budgets"][0]["N_opt"]
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or threads)
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: ScalingConfig) -> dict:
    from rich.table import Table

    from .console import make_console

    if not 0 < cfg.ci < 1:
        raise ScalingFitError(f"ci must be in (0, 1), got {cfg.ci}")
    if any(not (math.isfinite(c) and c > 0) for c in cfg.budgets):
        raise ScalingFitError(f"--budget values must be positive FLOP counts, got {cfg.budgets}")
    pts = read_points(cfg.inputs, cfg.params)
    n_read = len(pts.N)
    for expr in cfg.exclude:
        drop = parse_exclude(expr)({"N": pts.N, "D": pts.D, "C": pts.C, "loss": pts.loss})
        pts = pts.select(~drop)
    grid = start_grid(cfg.grid_alpha, cfg.grid_beta, cfg.grid_e, cfg.grid_a, cfg.grid_b)
    fit = fit_scaling_law(pts.N, pts.D, pts.loss, starts_SK=grid, delta=cfg.huber_delta, max_iter=cfg.max_iter,
                          ftol=cfg.ftol, gtol=cfg.gtol, memory=cfg.memory, polish=cfg.polish)
    p = {"E": fit.E, "A": fit.A, "B": fit.B, "alpha": fit.alpha, "beta": fit.beta}
    opt = compute_optimal(**p, C=cfg.budgets)
    report = {**p, "objective": fit.objective, "n_points": fit.n_points, "a": fit.a, "b": fit.b,
              "params": cfg.params,
              "params_note": f"run directories: N = stats.{PARAMS_KEYS[cfg.params]} of run_config.yaml; "
                             "CSV files: the N column as given",
              "budgets": [{"C": c, **{k: float(v[j]) for k, v in opt.items()}} for j, c in enumerate(cfg.budgets)],
              "fit": {"n_starts": fit.n_starts, "n_converged": fit.n_converged, "seconds": fit.seconds,
                      "grid_objective": fit.grid_objective, "polished": cfg.polish,
                      "huber_delta": cfg.huber_delta, "method": "batched L-BFGS (scipy L-BFGS-B rules) from every "
                      "grid start; objective = sum of Huber(log-sum-exp prediction - log loss)"},
              "inputs": list(cfg.inputs), "exclude": list(cfg.exclude), "n_excluded": n_read - len(pts.N)}
    if cfg.bootstrap > 0:
        samp = bootstrap_fits(pts.N, pts.D, pts.loss, fit, n=cfg.bootstrap, n_starts=cfg.bootstrap_starts,
                              seed=cfg.seed, delta=cfg.huber_delta, memory=cfg.memory)
        E, A, B, al, be = samp.T
        cols = {"E": E, "A": A, "B": B, "alpha": al, "beta": be, "a": be / (al + be), "b": al / (al + be)}
        bopt = compute_optimal(E[:, None], A[:, None], B[:, None], al[:, None], be[:, None], np.array(cfg.budgets))
        report["bootstrap"] = {
            "n": cfg.bootstrap, "n_converged": int(np.isfinite(al).sum()), "ci": cfg.ci,
            "starts_per_replica": len(distinct_optima(fit.optima_SK, cfg.bootstrap_starts)),
            "intervals": {k: _interval(v, cfg.ci) for k, v in cols.items()},
            "budgets": [{k: _interval(v[:, j], cfg.ci) for k, v in bopt.items()} for j in range(len(cfg.budgets))]}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fit.json").write_text(json.dumps(report, indent=2) + "\n")
    if cfg.plot:
        plot_fit(pts, fit, list(cfg.budgets), out / "fit.png")

    console = make_console()
    iv = report.get("bootstrap", {}).get("intervals", {})
    tab = Table(title="L(N, D) = E + A/N^alpha + B/D^beta",
                caption=f"{fit.n_points} points; N of run directories = {cfg.params} non-embedding parameters")
    tab.add_column("parameter")
    tab.add_column("value", justify="right")
    if iv:
        tab.add_column(f"{100 * cfg.ci:g}% bootstrap interval ({cfg.bootstrap} resamples)", justify="right")
    for k in ("E", "A", "B", "alpha", "beta", "a", "b"):
        lo_hi = ", ".join("n/a" if v is None else f"{v:.4g}" for v in iv.get(k, ()))
        tab.add_row(k, f"{report[k]:.4g}", *([f"[{lo_hi}]"] if iv else []))
    console.print(tab)
    if cfg.budgets:
        bt = Table(title="compute-optimal allocation (C = 6 N D)")
        for col in ("C (FLOPs)", "N_opt", "D_opt", "tokens/param", "loss"):
            bt.add_column(col, justify="right")
        for r in report["budgets"]:
            bt.add_row(*(f"{r[k]:.4g}" for k in ("C", "N_opt", "D_opt", "tokens_per_param", "loss")))
        console.print(bt)
    console.print(f"objective {fit.objective:.6g}; {fit.n_converged}/{fit.n_starts} starts converged in "
                  f"{fit.seconds:.2f} s; {report['n_excluded']} point(s) excluded; wrote {out / 'fit.json'}"
                  + (f" and {out / 'fit.png'}" if cfg.plot else ""))
    return report
