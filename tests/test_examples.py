"""examples/: every YAML config resolves through k3's own config loading for the command its header names (the
`k3 COMMAND [--preset P] --config examples/FILE` line a user copies), every shell script parses (`bash -n`), every
Python script compiles, and every example file is referenced from examples/README.md, which names no missing file.
Example files: the .yaml, .yml, .sh, .py and .md files; what the examples wrote (results/ folders, .csv, .json, .png)
are outputs, not examples."""

import inspect
import py_compile
import re
import subprocess
from pathlib import Path

import pytest

from k3.cli.config import resolve_config
from k3.model.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
README = EXAMPLES / "README.md"
SUFFIXES = {".yaml", ".yml", ".sh", ".py", ".md"}


def _example_files() -> list[Path]:
    return sorted(p for p in EXAMPLES.rglob("*") if p.is_file() and p.suffix in SUFFIXES and p != README
                  and "results" not in p.relative_to(EXAMPLES).parts and "__pycache__" not in p.parts)


def _rel(p: Path) -> str:
    return p.relative_to(EXAMPLES).as_posix()


def _ids(files):
    return [_rel(p) for p in files]


YAMLS = [p for p in _example_files() if p.suffix in (".yaml", ".yml")]
SCRIPTS = [p for p in _example_files() if p.suffix == ".sh"]
PYTHONS = [p for p in _example_files() if p.suffix == ".py"]


def _usage(path: Path) -> tuple[str, str | None]:
    """(command, preset) from the file's own usage line `k3 COMMAND [--preset P] --config examples/<this file>`."""
    text = re.sub(r"\n#\s*", " ", path.read_text())  # a usage line may wrap over comment lines
    m = re.search(rf"k3 ([a-z][\w-]*)([^`\n]*?) --config examples/{re.escape(_rel(path))}\b", text)
    assert m, f"{path}: its header needs the command that uses it, e.g. `k3 pretrain --preset tiny --config " \
              f"examples/{_rel(path)} --out runs/x`"
    preset = re.search(r"(?:--preset|-p) (\S+)", m.group(2))
    return m.group(1), preset.group(1) if preset else _default_preset(m.group(1))


def _default_preset(command: str) -> str | None:
    """The --preset default of `k3 COMMAND`, read from the command itself (what a run without --preset uses)."""
    from k3.cli.main import app

    fn = next(c.callback for c in app.registered_commands if c.name == command)
    option = inspect.signature(fn).parameters.get("preset")
    return None if option is None else option.default.default


def _resolve(path: Path):
    command, preset = _usage(path)
    return resolve_config(command, preset=preset, config_files=[str(path)])


def test_there_are_examples_of_each_kind():
    assert YAMLS and SCRIPTS and PYTHONS
    assert {"pretrain_small_gpu.yaml", "lm_eval.sh", "cpu_quickstart.sh", "openai_client.py"} <= set(
        _ids(_example_files()))


@pytest.mark.parametrize("path", YAMLS, ids=_ids(YAMLS))
def test_yaml_config_resolves_for_its_command(path):
    cfg = _resolve(path)
    assert cfg.train is not None or cfg.serve is not None or cfg.quantize is not None or cfg.distill is not None


def test_the_yaml_check_rejects_an_unknown_key(tmp_path, monkeypatch):
    bad = EXAMPLES / "pretrain_own_text.yaml"
    copy = tmp_path / "examples" / "bad.yaml"
    copy.parent.mkdir()
    copy.write_text(bad.read_text().replace("pretrain_own_text.yaml", "bad.yaml").replace("max_steps:", "max_step:"))
    monkeypatch.setitem(globals(), "EXAMPLES", tmp_path / "examples")  # _rel() of the copy
    with pytest.raises(ConfigError, match="max_step"):
        _resolve(copy)


@pytest.mark.parametrize("path", SCRIPTS, ids=_ids(SCRIPTS))
def test_shell_script_parses(path):
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("path", PYTHONS, ids=_ids(PYTHONS))
def test_python_script_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_every_example_is_documented_in_the_readme():
    text = README.read_text()
    missing = [_rel(p) for p in _example_files() if _rel(p) not in text]
    assert not missing, f"examples/README.md does not mention {missing}: add a section with the command and its output"
    named = set(re.findall(r"examples/([\w./-]+\.(?:ya?ml|sh|py|md))", text))
    assert named, "examples/README.md names no example as examples/FILE"
    dangling = sorted(n for n in named if not (EXAMPLES / n).is_file())
    assert not dangling, f"examples/README.md names files that do not exist: {dangling}"
