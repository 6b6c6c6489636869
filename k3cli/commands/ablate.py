"""`k3 ablate`: parse flags -> k3.train.ablate.run_suites (or --list / --report-only)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3.cli.errors import friendly_errors


@friendly_errors
def ablate(
    suites: Annotated[list[str] | None, typer.Argument(help="suites to run, e.g. attnres balance (k3 ablate --list)",
                                                       show_default=False)] = None,
    scale: Annotated[str, typer.Option("--scale", help="tiny (2 CPU cores: claims 1-8 in about an hour, the "
                                                       "opd suite up to 45 minutes more) or small (one H200: the "
                                                       "small preset)")] = "tiny",
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="repeat every arm with train.seed = 0..N-1")] = 1,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="directory: SUITE/ARM/seed-S/ runs and "
                                                                 "report.md")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="continue interrupted runs from their checkpoints")] = False,
    list_: Annotated[bool, typer.Option("--list", help="print the suites, one line each, and exit")] = False,
    report_only: Annotated[bool, typer.Option("--report-only", help="train nothing: rewrite OUT/report.md from "
                                                                    "the finished runs")] = False,
) -> None:
    """Reproduce the K3 report's claims at small scale: paired runs through k3 pretrain / extend-context /
    quantize / distill (same loop, data, seeds and tokens), then OUT/report.md with tables, verdicts, plots and the
    exact commands.

    Finished runs are skipped when the command is run again; --resume continues interrupted ones. docs/ablate.md.
    """
    from k3.train.ablate import AblateError, list_lines, run_suites
    from k3.train.ablate_report import write_report

    if list_:
        for line in list_lines():
            print(line)
        return
    if out is None:
        raise AblateError("--out DIR is required (the suite's runs and report.md go there)")
    if report_only:
        print(f"wrote {write_report(out)}")
        return
    from k3.cli.config import apply_kernels, environment_info, resolve_config
    from k3.serve.generate import generate_batch

    def resolve(command: str, preset: str, sets: list[str], overrides: dict | None):
        cfg = resolve_config(command, preset=preset, sets=sets, overrides=overrides)
        apply_kernels(cfg)
        return cfg

    res = run_suites(list(suites or []), scale, seeds, out, resume, resolve=resolve, generate_batch=generate_batch,
                     env=environment_info())
    if res["stop_signal"] is not None:
        raise typer.Exit(code=128 + res["stop_signal"])
