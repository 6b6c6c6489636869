"""The `k3` command line: one small module per subcommand under k3.cli.commands; no logic here."""

from __future__ import annotations

import typer

from k3.cli.commands.generate import generate
from k3.cli.commands.pretrain import pretrain
from k3.cli.commands.scaling_fit import scaling_fit

app = typer.Typer(
    name="k3",
    help="k3: the Kimi K3 architecture from a laptop CPU to GPUs (pretrain, generate, scaling-fit, ...).",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
app.command("pretrain")(pretrain)
app.command("generate")(generate)
app.command("scaling-fit")(scaling_fit)


if __name__ == "__main__":
    app()
