"""`k3 scaling-fit` through Typer: writes fit.json and fit.png, reads run directories, bad input exits with code 2."""

import json

import numpy as np
import pytest
import torch
import typer
import yaml
from typer.testing import CliRunner

from k3.cli.commands.scaling_fit import scaling_fit


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/train/test_scaling.py: small ops on a shared 2-core box
    yield
    torch.set_num_threads(n)


def make_app() -> typer.Typer:
    app = typer.Typer()
    app.command("scaling-fit")(scaling_fit)
    app.command("noop")(lambda: None)  # two commands, so the subcommand name is part of the command line as in k3
    return app


def chinchilla_points(P=24, seed=0):
    rng = np.random.default_rng(seed)
    C = np.repeat(np.logspace(18, 21, 4), P // 4)
    N = np.exp(rng.uniform(np.log(1e7), np.log(3e9), P))
    D = C / (6 * N)
    L = (1.69 + 406.4 / N ** 0.34 + 410.7 / D ** 0.28) * np.exp(rng.normal(0, 0.003, P))
    return N, D, L


def test_cli_writes_fit_json_and_png(tmp_path):
    N, D, L = chinchilla_points()
    csv = tmp_path / "runs.csv"
    csv.write_text("params,tokens,LOSS\n" + "".join(f"{n:.17g},{d:.17g},{v:.17g}\n" for n, d, v in zip(N, D, L))
                   + "2e6,1e9,8.0\n")
    out = tmp_path / "fit"
    res = CliRunner().invoke(make_app(), ["scaling-fit", str(csv), "--out", str(out), "--budget", "1e21",
                                          "--budget", "5.76e23", "--bootstrap", "3", "--exclude", "N<5e6"])
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "fit.json").read_text())
    for key in ("E", "A", "B", "alpha", "beta", "objective", "n_points", "a", "b", "params", "budgets", "bootstrap"):
        assert key in rep, key
    assert rep["n_points"] == 24 and rep["n_excluded"] == 1 and rep["params"] == "active"
    assert rep["fit"]["n_starts"] == 4500
    assert [b["C"] for b in rep["budgets"]] == [1e21, 5.76e23]
    for b in rep["budgets"]:
        assert set(b) == {"C", "N_opt", "D_opt", "tokens_per_param", "loss"}
        assert 6 * b["N_opt"] * b["D_opt"] == pytest.approx(b["C"])
    iv = rep["bootstrap"]["intervals"]
    assert set(iv) == {"E", "A", "B", "alpha", "beta", "a", "b"} and all(lo <= hi for lo, hi in iv.values())
    assert len(rep["bootstrap"]["budgets"]) == 2
    png = (out / "fit.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert "alpha" in res.output and "N_opt" in res.output


def test_cli_reads_run_directories_with_total_params(tmp_path):
    N, D, L = chinchilla_points(P=12, seed=1)
    for i, (n, d, v) in enumerate(zip(N, D, L)):
        run = tmp_path / "runs" / f"run{i}"
        run.mkdir(parents=True)
        stats = {"n_params_active_nonembed": float(n), "n_params_total_nonembed": float(4 * n), "tokens": float(d)}
        (run / "run_config.yaml").write_text(yaml.safe_dump({"stats": stats}))
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": float(v) + 1, "tokens": float(d) / 2})
                                           + "\n" + json.dumps({"step": 2, "tokens": float(d), "val_loss": float(v)})
                                           + "\n")
    reps = {}
    for mode in ("active", "total"):
        res = CliRunner().invoke(make_app(), ["scaling-fit", str(tmp_path / "runs"), "--out", str(tmp_path / mode),
                                              "--params", mode])
        assert res.exit_code == 0, res.output
        reps[mode] = json.loads((tmp_path / mode / "fit.json").read_text())
        assert reps[mode]["params"] == mode and reps[mode]["n_points"] == 12
    act, tot = reps["active"], reps["total"]
    # N_total = 4 N_active is absorbed by A: A_total = A_active 4^alpha with the other parameters unchanged
    assert tot["alpha"] == pytest.approx(act["alpha"], abs=1e-3) and tot["beta"] == pytest.approx(act["beta"], abs=1e-3)
    assert tot["A"] == pytest.approx(act["A"] * 4 ** act["alpha"], rel=1e-2)
    assert tot["objective"] == pytest.approx(act["objective"], rel=1e-3)


@pytest.mark.parametrize("text, message", [
    ("N,D\n1,2\n", "missing column"),
    ("N,D,loss\n1e6,1e8,3\n2e6,2e8,3\n3e6,-3e8,3\n", "must be a finite number > 0"),
    ("N,D,loss\n1e6,1e8,3\n2e6,2e8,nan\n", "must be a finite number > 0"),
    ("N,D,loss\n1e6,1e8,3\n2e6,2e8,2.9\n", "at least 5 points"),
], ids=["missing-column", "negative", "nan", "too-few"])
def test_cli_bad_input_exits_2_without_traceback(tmp_path, text, message):
    csv = tmp_path / "bad.csv"
    csv.write_text(text)
    res = CliRunner().invoke(make_app(), ["scaling-fit", str(csv), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert message in res.output and "error:" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o" / "fit.json").exists()


def test_cli_rejects_unsafe_exclude(tmp_path):
    csv = tmp_path / "p.csv"
    csv.write_text("N,D,loss\n" + "".join(f"{n},{n * 20},{3 + 1 / n}\n" for n in (1e6, 2e6, 4e6, 8e6, 1.6e7)))
    res = CliRunner().invoke(make_app(), ["scaling-fit", str(csv), "--exclude", "__import__('os').getcwd()"])
    assert res.exit_code == 2 and "not allowed" in res.output
