"""`k3 pretrain` as a shell runs it, a subprocess with piped output: unwrapped lines, exit status 128 + N after a
signal, empty corpus files skipped with a warning, no run directory after a failed start, the parameter line."""

import signal
import subprocess

import pytest
from typer.testing import CliRunner


def test_piped_output_keeps_long_paths_on_one_line(tmp_path, pretrain_cmd, piped_env):
    out = tmp_path / "a-run-directory-whose-name-alone-is-longer-than-half-of-an-80-column-line" / "tiny"
    r = subprocess.run(pretrain_cmd(out, "--set", "train.max_steps=2"), capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env=piped_env, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any(line.endswith(f"checkpoint: {out / 'final'}") for line in lines), r.stdout
    assert any(line.endswith(f"run dir {out}") for line in lines), r.stdout


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_exits_128_plus_n_after_checkpoint_and_resume_hint(tmp_path, pretrain_cmd, piped_env, sig):
    out = tmp_path / "run"
    proc = subprocess.Popen(pretrain_cmd(out, "--set", "train.max_steps=100000"), cwd=tmp_path,
                            env=piped_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in proc.stdout:  # the first log line: the train loop runs, its signal handlers are installed
            seen.append(line)
            if line.startswith("step 1/"):
                proc.send_signal(sig)
                break
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    stdout = "".join(seen) + rest
    assert proc.returncode == 128 + sig, stdout + err
    assert f"Continue with: k3 pretrain --resume --out {out}" in stdout, stdout
    assert any((d / "COMPLETE").is_file() for d in (out / "checkpoints").iterdir())


def test_ctrl_c_before_the_train_loop_exits_130(tmp_path, monkeypatch):
    # Ctrl-C while the data is prepared or the model is built: Python's KeyboardInterrupt, not the loop's handler
    import k3.train.pretrain
    from k3.cli.main import app

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(k3.train.pretrain, "run", interrupted)
    res = CliRunner().invoke(app, ["pretrain", "--preset", "debug", "--out", str(tmp_path / "run")])
    assert res.exit_code == 130 and res.stderr == "interrupted\n", res.output


def _corpus(d, n, empty=()):
    d.mkdir(parents=True)
    for i in range(n):
        (d / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 40)
    for name in empty:
        (d / name).write_text("\n")
    return d


def test_an_empty_file_in_a_corpus_is_skipped_with_a_warning(tmp_path, pretrain_cmd, piped_env):
    corpus = _corpus(tmp_path / "corpus", 6, empty=["blank.txt"])
    out = tmp_path / "run"
    r = subprocess.run(pretrain_cmd(out, "--set", f"data.source={corpus}", "--set", "train.max_steps=2"),
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=piped_env, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    warning = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    head = f"warning: data.source: skipped 1 of 7 files that hold no document: {corpus / 'blank.txt'} (all listed in "
    assert len(warning) == 1 and warning[0].startswith(head), r.stderr
    assert (out / "final" / "model.safetensors").is_file()


def test_a_failed_start_leaves_no_run_directory(tmp_path, pretrain_cmd, piped_env):
    runs = tmp_path / "runs"
    (runs / "earlier").mkdir(parents=True)  # another run's directory: kept
    corpus = _corpus(tmp_path / "empty-corpus", 0, empty=["a.txt", "b.txt"])
    out = runs / "new" / "run"
    r = subprocess.run(pretrain_cmd(out, "--set", f"data.source={corpus}"), capture_output=True,
                       text=True, timeout=300, cwd=tmp_path, env=piped_env, check=False)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stdout + r.stderr
    assert r.stderr.startswith(f"error: data.source '{corpus}': no usable file; every file read holds no document: "
                               f"{corpus / 'a.txt'}, {corpus / 'b.txt'}; "), r.stderr
    assert not (runs / "new").exists()
    # a failure after the run directory was made (a sequence longer than the training split) removes it again
    r = subprocess.run(pretrain_cmd(out, "--set", "data.seq_len=1000000"), capture_output=True,
                       text=True, timeout=300, cwd=tmp_path, env=piped_env, check=False)
    assert r.returncode == 2 and "error: the train split has" in r.stderr, r.stdout + r.stderr
    assert not (runs / "new").exists() and [p.name for p in runs.iterdir()] == ["earlier"]


def test_pretrain_reports_the_parameters_a_loaded_checkpoint_has(tmp_path, pretrain_cmd, piped_env):
    import yaml

    from k3.model.checkpoint import load_model
    from k3.model.transformer import count_parameters, describe_parameters

    out = tmp_path / "run"
    r = subprocess.run(pretrain_cmd(out, "--set", "train.max_steps=1"), capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env=piped_env, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    model, _ = load_model(out / "final")  # as `k3 serve` and `k3 generate` load it
    counts = count_parameters(model)
    assert f"k3 pretrain k3-debug: {describe_parameters(counts)}, " in r.stdout, r.stdout
    stats = yaml.safe_load((out / "final" / "k3_run.yaml").read_text())["stats"]
    assert (stats["n_params_total"], stats["n_params_active"], stats["n_params_mtp"]) == (
        counts["total"], counts["active"], counts["mtp"])
