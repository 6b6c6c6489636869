"""`k3 scaling-fit INPUT...`: parse flags -> ScalingConfig -> k3.train.scaling.run."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from k3.cli.errors import friendly_errors
from k3.train.config import ScalingConfig


class ParamsMode(str, Enum):
    active = "active"
    total = "total"


@friendly_errors
def scaling_fit(
    inputs: Annotated[list[Path], typer.Argument(
        help="CSV files with columns N (or params), D (or tokens), loss and optionally C (or flops), any letter "
             "case; and/or k3 run directories (or a folder of them) written by `k3 pretrain`")],
    out: Annotated[Path, typer.Option("--out", "-o", help="output directory for fit.json and fit.png")] = Path(
        "scaling_fit"),
    bootstrap: Annotated[int, typer.Option(
        "--bootstrap", min=0, help="refit this many resamples of the points (drawn with replacement) and report 95% "
                                   "percentile intervals for every parameter; 0 = none")] = 0,
    budget: Annotated[list[float] | None, typer.Option(
        "--budget", help="compute budget C in FLOPs, e.g. 1e21: prints N_opt, D_opt, tokens per parameter and the "
                         "predicted loss under C = 6ND; repeatable")] = None,
    params: Annotated[ParamsMode, typer.Option(
        "--params", help="N of run directories: active (MoE: only the experts a token uses) or total non-embedding "
                         "parameters; the N column of a CSV is used as given")] = ParamsMode.active,
    exclude: Annotated[list[str] | None, typer.Option(
        "--exclude", help="drop the points matching a filter on N, D, C, loss: comparisons joined by and / or / not, "
                          "e.g. \"N<1e7\", \"loss>5 or D<1e9\", \"not 1e7<=N<=1e9\"; repeatable")] = None,
) -> None:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta to runs and plan compute-optimal runs (Chinchilla approach 3).

    Huber loss on log-loss, L-BFGS from all 4500 grid starts in one batch. Writes DIR/fit.json (E, A, B, alpha, beta,
    a = beta/(alpha+beta), b = alpha/(alpha+beta), N_opt / D_opt / loss per --budget, bootstrap intervals) and
    DIR/fit.png (loss vs compute, iso-FLOP curves, loss vs N at fixed D), and prints a table.
    """
    from k3.train.scaling import ScalingFitError, run

    cfg = ScalingConfig(inputs=[str(p) for p in inputs], out=str(out), bootstrap=bootstrap, budgets=list(budget or []),
                        params=params.value, exclude=list(exclude or []))
    try:
        run(cfg)
    except ScalingFitError as e:  # bad input: the message names the problem and the fix; no traceback
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(code=2) from None
