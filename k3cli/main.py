"""The `k3` command line: one small module per subcommand under k3.cli.commands; no logic here."""

from __future__ import annotations

import os

from k3.cli.host import omp_wait_env, retain_freed_memory

# before torch loads OpenMP: brief spinning when the cores are idle, passive waiting when they are shared
# (k3cli/host.py has the measurements); a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins
os.environ.update(omp_wait_env(os.environ))

import typer

from k3.cli.commands.ablate import ablate
from k3.cli.commands.distill import distill
from k3.cli.commands.eval import app as eval_app
from k3.cli.commands.export_hf import export_hf
from k3.cli.commands.extend_context import extend_context
from k3.cli.commands.generate import generate
from k3.cli.commands.pretrain import pretrain
from k3.cli.commands.quantize import quantize
from k3.cli.commands.scaling_fit import scaling_fit
from k3.cli.commands.serve import serve
from k3.cli.commands.sweep import sweep

# before any tensor exists: CPU training page-faults every freed activation again otherwise (k3cli/host.py)
retain_freed_memory()

app = typer.Typer(
    name="k3",
    help="k3: the Kimi K3 architecture from a laptop CPU to GPUs: pretrain, extend-context, distill, quantize, "
         "export-hf, eval, generate, serve, sweep, scaling-fit, ablate.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"k3 {version('k3')}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="print k3's version and exit")) -> None:
    # a callback turns the app into a group with options of its own; the commands below stay its subcommands
    pass


app.command("pretrain")(pretrain)
app.command("extend-context")(extend_context)
app.add_typer(eval_app, name="eval")
app.command("distill")(distill)
app.command("quantize")(quantize)
app.command("export-hf")(export_hf)
app.command("generate")(generate)
app.command("scaling-fit")(scaling_fit)
app.command("serve")(serve)
app.command("sweep")(sweep)
app.command("ablate")(ablate)


if __name__ == "__main__":
    app()
