"""Packaging (style.md section 2): namespace mapping, explicit package list, no forbidden top-level imports,
wheel and editable installs importable from outside the repository."""

import ast
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAPPING = {"k3cli": "k3.cli", "k3kernels": "k3.kernels", "model": "k3.model", "train": "k3.train", "serve": "k3.serve"}


def test_package_list_matches_folders():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(py["tool"]["setuptools"]["packages"])
    found = set()
    for folder, name in MAPPING.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    found.add("k3")  # k3main/: only __main__.py, mapped to the namespace itself (`python -m k3`)
    assert listed == found, f"pyproject packages differ from folders: missing {found - listed}, extra {listed - found}"
    assert sorted(p.name for p in (ROOT / "k3main").iterdir() if p.name != "__pycache__") == ["__main__.py"]


def test_no_forbidden_top_level_imports():
    bad = []
    for folder in MAPPING:
        for f in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                bad += [f"{f.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in MAPPING]
    assert not bad, bad


def test_dependency_direction():
    """k3.kernels imports only torch/triton; k3.model never imports k3.train/serve/cli; k3.train never k3.cli/serve."""
    rules = {"k3kernels": ("k3.model", "k3.train", "k3.serve", "k3.cli"), "model": ("k3.train", "k3.serve", "k3.cli"),
             "train": ("k3.cli", "k3.serve"), "serve": ("k3.cli", "k3.train")}
    bad = []
    for folder, forbidden in rules.items():
        for f in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
                bad += [f"{f.relative_to(ROOT)} imports {m}" for m in mods if m.startswith(forbidden)]
    assert not bad, bad


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, **kw)


# the source folders must not be importable under their own names from an install (only as k3.*)
CHECK = ("import importlib.util, k3.cli, k3.kernels, k3.model, k3.train, k3.serve; "
         "s = importlib.util.find_spec('k3kernels'); "
         "print('KERNELS', None if s is None else s.origin)")


@pytest.mark.slow
def test_wheel_and_editable_install_import_from_outside(tmp_path):
    # wheel: build, install into a target dir, import from a directory outside the repo
    wheel_dir = tmp_path / "wheels"
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir),
              str(ROOT)])
    assert r.returncode == 0, r.stderr
    site = tmp_path / "site"
    whl = next(wheel_dir.glob("k3-*.whl"))
    r = _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(whl)])
    assert r.returncode == 0, r.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    r = _run([sys.executable, "-c", CHECK], cwd=outside, env=env)
    assert r.returncode == 0, r.stderr
    assert str(ROOT) not in r.stdout
    r = _run([sys.executable, "-c", "from k3.cli.main import app; app()", "--help"], cwd=outside, env=env)
    assert r.returncode == 0 and "pretrain" in r.stdout, r.stdout + r.stderr
    r = _run([sys.executable, "-m", "k3", "--help"], cwd=outside, env=env)  # k3main/__main__.py in the wheel
    assert r.returncode == 0 and "pretrain" in r.stdout, r.stdout + r.stderr
    # editable (the dev install): importable from outside, and 'k3kernels' does not resolve into the repo
    r = _run([sys.executable, "-c", CHECK], cwd=outside)
    assert r.returncode == 0, r.stderr
    origin = r.stdout.split("KERNELS", 1)[1].strip()
    assert origin == "None" or not origin.startswith(str(ROOT)), origin


def test_no_source_folder_has_the_name_of_an_installed_package():
    # transformers >= 5.25 imports Hugging Face's `kernels` package; this repository's kernels/ folder (now
    # k3kernels/) shadowed it for any Python started in the repository root (`python -m pytest`, `python -m k3`), and
    # `import k3.model.hf` failed with "cannot import name 'CUDAProperties' from 'kernels'"
    names = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name.isidentifier())
    code = ("import importlib.util, json, sys; "
            "print(json.dumps([n for n in sys.argv[1:] if importlib.util.find_spec(n) is not None]))")
    # -P: the working directory (the repository) is not put on sys.path, so only installed packages are found
    r = _run([sys.executable, "-P", "-c", code, *names], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    clash = json.loads(r.stdout)
    assert clash == [], f"repository folders {clash} shadow installed packages of the same name when Python runs here"


def test_license_file_is_the_apache_license_pyproject_names():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert py["project"]["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert text.rstrip().endswith("limitations under the License.")


def test_version_flag_and_python_m_k3_from_outside(tmp_path):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    k3 = Path(sys.executable).parent / "k3"  # the console script of this environment
    for cmd in ([str(k3), "--version"], [sys.executable, "-m", "k3", "--version"],
                [sys.executable, "-m", "k3.cli", "--version"]):
        r = _run(cmd, cwd=tmp_path)
        assert (r.returncode, r.stdout, r.stderr) == (0, f"k3 {version}\n", ""), cmd
    r = _run([sys.executable, "-m", "k3.cli", "generate", "--help"], cwd=tmp_path)
    assert r.returncode == 0 and "Usage: k3 generate" in r.stdout, r.stdout + r.stderr
    r = _run([sys.executable, "-m", "k3.cli", "no-such-command"], cwd=tmp_path)
    assert r.returncode == 2 and "No such command" in r.stderr
