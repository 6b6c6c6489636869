"""Import structure, read from the source with `ast` (imports inside functions included): no import circle inside any
package, and serve/ in one-way layers (docs/design.md: http -> engine -> speculative -> runner -> cache), where the
speculative code never reaches the engine and nothing in serve/ calls a kernel (the model does)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"k3cli": "k3.cli", "k3kernels": "k3.kernels", "model": "k3.model", "train": "k3.train", "serve": "k3.serve"}

# serve/'s layers, top to bottom: a module imports only modules of its own layer or below ("leaf" ones from anywhere)
SERVE_LAYERS = {
    "http": ("server", "jobs", "protocol", "chat", "generate", "lm_eval"),
    "engine": ("engine", "scheduler", "speculation", "request", "sampling", "output", "metrics"),
    "speculative": ("proposer", "verify", "spec_step"),
    "runner": ("runner", "graphs", "static", "step"),
    "cache": ("cache", "pools"),
    "leaf": ("config", "__init__"),
}


def _module_name(path: Path, folder: str) -> str:
    rel = path.relative_to(ROOT / folder).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGES[folder], *parts])


def _imports(path: Path, folder: str) -> set[str]:
    """Every k3 module `path` imports (relative imports resolved; `from pkg import name` counts pkg and pkg.name)."""
    me = _module_name(path, folder)
    pkg = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("k3.")}


def _graph(folder: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    files = {_module_name(f, folder): f for f in (ROOT / folder).rglob("*.py")}
    return {m: {d for d in _imports(f, folder) if d in files and d != m} for m, f in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph, or None (depth-first search with colours)."""
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_cycle_finder_finds_a_planted_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_no_import_circle_inside_a_package(folder):
    # a package imports its own __init__ (the package) when a submodule does `from . import x`: not a circle of modules
    graph = {m: {d for d in deps if d != PACKAGES[folder]} for m, deps in _graph(folder).items()}
    assert _cycle(graph) is None, f"import circle in {folder}/: {' -> '.join(_cycle(graph))}"


def test_serve_modules_are_all_in_a_layer():
    listed = {m for mods in SERVE_LAYERS.values() for m in mods}
    found = {f.stem for f in (ROOT / "serve").glob("*.py")}
    assert found == listed, f"unlisted: {found - listed}, gone: {listed - found}"


def test_serve_imports_point_down_the_layers():
    rank = {m: i for i, mods in enumerate(SERVE_LAYERS.values()) for m in mods}
    leaf = set(SERVE_LAYERS["leaf"])
    bad = []
    for mod, deps in _graph("serve").items():
        me = mod.rsplit(".", 1)[-1] if mod != "k3.serve" else "__init__"
        for d in deps:
            dep = d.rsplit(".", 1)[-1]
            if dep not in leaf and rank[dep] < rank[me]:
                bad.append(f"{me} ({list(SERVE_LAYERS)[rank[me]]}) imports {dep} ({list(SERVE_LAYERS)[rank[dep]]})")
    assert not bad, bad


def test_serve_runs_no_kernel_and_speculation_never_reaches_the_engine():
    bad = []
    for f in (ROOT / "serve").glob("*.py"):
        deps = _imports(f, "serve")
        bad += [f"{f.name} imports {d}" for d in deps if d.startswith("k3.kernels")]
        if f.stem in SERVE_LAYERS["speculative"]:
            bad += [f"{f.name} imports {d}" for d in deps if d.rsplit(".", 1)[-1] in SERVE_LAYERS["engine"]]
    assert not bad, bad
