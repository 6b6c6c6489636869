"""`python -m k3.cli ARGS`: the `k3` command where the console script is not on PATH (a venv not activated, a
wheel installed with --target). k3 itself is an implicit namespace package assembled by pyproject's package-dir
mapping, with no folder of its own, so `python -m k3` finds no k3/__main__.py to run."""

from k3.cli.main import app

app(prog_name="k3")
