"""`k3 sweep`: parse flags -> k3.train.sweep.plan_sweep -> print the commands (--dry-run) or run_sweep."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from k3.cli.errors import friendly_errors


class ParamsMode(str, Enum):
    active = "active"
    total = "total"


@friendly_errors
def sweep(
    preset: Annotated[str, typer.Option("--preset", "-p", help="pretrain preset the sizes are derived from "
                                                                "(debug, tiny, small)")],
    sizes: Annotated[str, typer.Option("--sizes", help="target model sizes N, comma-separated, with optional "
                                                       "suffix k, M, B: e.g. 25k,50k,100k")],
    tokens_per_param: Annotated[str, typer.Option("--tokens-per-param", help="training tokens per parameter "
                                                                             "D/N, comma-separated: e.g. 5,10,20")],
    out: Annotated[Path, typer.Option("--out", "-o", help="sweep directory: runs/<size>-<ratio>/ and runs.csv")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="override a field of every run, e.g. --set train.batch_size=8; model.* fields change "
                            "the base model the sizes are scaled from; repeatable")] = None,
    params: Annotated[ParamsMode, typer.Option(
        "--params", help="what N counts: active (MoE: the experts a token uses) or total non-embedding "
                         "parameters; pass the same --params to k3 scaling-fit")] = ParamsMode.active,
    tolerance: Annotated[float, typer.Option(
        "--tolerance", min=0.0, help="relative N error within which the shape closest to the preset's aspect "
                                     "ratio d/L wins over the closest N")] = 0.10,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the plan and one `k3 pretrain` command per run; "
                                                            "train nothing")] = False,
) -> None:
    """Train a grid of K3-shaped models (sizes x tokens per parameter) for `k3 scaling-fit`.

    Each size gets a depth and width found by a search that keeps the K3 shape (MLA every 4th layer and the last,
    dense layer 0, latent width d/2, about 8 AttnRes blocks); each run trains ceil(ratio * N / tokens_per_step)
    steps in OUT/runs/<size>-<ratio>/. Finished runs are skipped and interrupted ones resumed when the command is
    run again. OUT/runs.csv (N, D, loss, C) feeds `k3 scaling-fit OUT/runs.csv`.
    """
    from k3.cli.config import apply_kernels, environment_info, resolve_config
    from k3.train.console import make_console
    from k3.train.sweep import parse_list, parse_ratio, parse_size, plan_sweep, plan_table, pretrain_command, run_sweep

    size_list = parse_list(sizes, "--sizes", parse_size)
    ratio_list = parse_list(tokens_per_param, "--tokens-per-param", parse_ratio)

    def resolve(sets: list[str]):
        return resolve_config("pretrain", preset=preset, sets=sets)

    plan = plan_sweep(resolve, preset=preset, sizes=size_list, ratios=ratio_list, sets=list(set_ or []), out=out,
                      params=params.value, tol=tolerance)
    err = make_console(stderr=True)
    err.print(plan_table(plan))
    if dry_run:
        for p in plan.points:  # plain print: one command per line, never wrapped, so stdout is a runnable script
            print(pretrain_command(plan, p))
        sys.stdout.flush()
        return
    res = run_sweep(plan, resolve, env=environment_info(), kernels=apply_kernels(resolve(list(set_ or []))),
                    console=make_console())
    if res.stop_signal is not None:
        raise typer.Exit(code=128 + res.stop_signal)  # as `k3 pretrain`: a stopped sweep is not a finished one
