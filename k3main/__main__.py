"""`python -m k3 ARGS`: the `k3` command without its console script (a venv not activated, a wheel installed with
--target). This folder is mapped to the `k3` namespace by pyproject's package-dir and holds only this file, so
`k3` stays a namespace package assembled from k3cli/, k3kernels/, model/, train/ and serve/."""

from k3.cli.main import app

app(prog_name="k3")
