"""`python -m k3.cli ARGS`: the `k3` command where the console script is not on PATH, as `python -m k3`
(k3main/__main__.py)."""

from k3.cli.main import app

app(prog_name="k3")
