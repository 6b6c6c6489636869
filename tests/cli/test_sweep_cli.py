"""`k3 sweep` through Typer: --dry-run prints one runnable `k3 pretrain` command per grid point and trains nothing;
bad input exits with code 2 and a one-line error, no traceback."""

import math
import shlex

import pytest
import typer
from typer.testing import CliRunner

from k3.cli.commands.sweep import sweep
from k3.cli.config import resolve_config
from k3.train.sweep import count_model


def make_app() -> typer.Typer:
    app = typer.Typer()
    app.command("sweep")(sweep)  # registered as k3.cli.main registers it
    app.command("noop")(lambda: None)  # two commands, so the subcommand name is part of the command line as in k3
    return app


def test_dry_run_prints_one_command_per_grid_point(tmp_path):
    out = tmp_path / "sw"
    res = CliRunner().invoke(make_app(), ["sweep", "--preset", "debug", "--sizes", "50k,25k,0.1M",
                                          "--tokens-per-param", "2,8", "--set", "train.batch_size=8",
                                          "--out", str(out), "--dry-run"])
    assert res.exit_code == 0, res.output
    cmds = [line for line in res.stdout.splitlines() if line.strip()]
    assert len(cmds) == 6 and all(c.startswith("k3 pretrain --preset debug ") for c in cmds), res.stdout
    assert not out.exists()  # nothing run, nothing written
    seen = set()
    for c in cmds:
        argv = shlex.split(c)
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        run_dir = argv[argv.index("--out") + 1]
        size, ratio = run_dir.rsplit("/", 1)[1].rsplit("-", 1)
        seen.add((size, float(ratio)))
        assert sets[0] == "train.batch_size=8"  # the user's overrides come first, the derived ones after
        cfg = resolve_config("pretrain", preset="debug", sets=sets)  # what `k3 pretrain` would build
        n = count_model(cfg.model)["active_nonembed"]
        target = {"25k": 25e3, "50k": 50e3, "100k": 100e3}[size]
        assert abs(n / target - 1) <= 0.10
        assert cfg.train.max_steps == math.ceil(float(ratio) * n / (8 * 64))
    assert seen == {(s, r) for s in ("25k", "50k", "100k") for r in (2.0, 8.0)}


@pytest.mark.parametrize("args, message", [
    (["--sizes", "50q", "--tokens-per-param", "2"], "is not a size"),
    (["--sizes", "50k", "--tokens-per-param", "two"], "is not a number"),
    (["--sizes", "50k", "--tokens-per-param", "0"], "must be a positive"),
    (["--sizes", "1k", "--tokens-per-param", "2"], "below the smallest model"),
    (["--sizes", "50k", "--tokens-per-param", "2", "--set", "train.max_steps=5"], "train.max_steps"),
    (["--sizes", "50k", "--tokens-per-param", "2", "--set", "model.d_modle=5"], "did you mean"),
], ids=["size-suffix", "ratio-word", "ratio-zero", "too-small", "max-steps", "unknown-key"])
def test_bad_input_exits_2_without_traceback(tmp_path, args, message):
    res = CliRunner().invoke(make_app(), ["sweep", "--preset", "debug", *args, "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert message in res.output and "error:" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()


def test_unknown_preset_lists_the_available_ones(tmp_path):
    res = CliRunner().invoke(make_app(), ["sweep", "--preset", "huge", "--sizes", "50k", "--tokens-per-param", "2",
                                          "--out", str(tmp_path / "o"), "--dry-run"])
    assert res.exit_code == 2 and "debug" in res.output and "Traceback" not in res.output
