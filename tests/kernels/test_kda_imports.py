"""The import structure of k3kernels/, read from the source with `ast` (nothing imported): no import cycle, the KDA
chunk forward and backward modules share only triton/common.py and triton/launch.py, `triton` is imported at module
level only by Triton modules (so `import k3.kernels` works without it), and nothing imports the packages built on
the kernels (k3.model, k3.serve, k3.train, k3.cli). Imports inside functions count like any other."""

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "k3kernels"
PACKAGE = "k3.kernels"
KDA_TRITON = f"{PACKAGE}.kda.triton"
# the chunk kernels' forward and backward modules of k3kernels/kda/triton/, and what both may import
FORWARD = {"chunk_fwd", "intra_fwd", "solve", "segments"}
BACKWARD = {"chunk_bwd", "intra_bwd"}
SHARED = {"common", "launch"}
OPS = {"gate", "norm", "recurrent"}  # ops of their own (each holds its forward and backward), used by the chunk path
FORBIDDEN = ("k3.model", "k3.serve", "k3.train", "k3.cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(KERNELS).with_suffix("").parts
    return ".".join((PACKAGE, *parts[:-1])) if parts[-1] == "__init__" else ".".join((PACKAGE, *parts))


MODULES = {module_name(p): p for p in sorted(KERNELS.rglob("*.py"))}


def imports(name: str) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import statement of module `name`; `from pkg import x` names
    the submodule pkg.x where one exists."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub if sub in MODULES else base, id(node) in top))
    return found


GRAPH = {name: {m for m, _ in imports(name) if m in MODULES and m != name} for name in MODULES}


def test_the_kda_triton_modules_are_all_classified():
    """Each module of k3kernels/kda/triton/ is a forward, backward, shared or op module (a new one must say which)."""
    found = {n.rpartition(".")[2] for n in MODULES if n.startswith(KDA_TRITON + ".")}
    assert found == FORWARD | BACKWARD | SHARED | OPS, found ^ (FORWARD | BACKWARD | SHARED | OPS)


def test_chunk_forward_and_backward_share_only_common_and_launch():
    def local(m):  # the k3kernels/kda/triton/ modules that m imports
        return {d.rpartition(".")[2] for d in GRAPH[f"{KDA_TRITON}.{m}"] if d.startswith(KDA_TRITON + ".")}

    bad = [f"{m} imports {d}" for fam, other in ((FORWARD, BACKWARD), (BACKWARD, FORWARD)) for m in fam
           for d in local(m) & other]
    bad += [f"{m} imports {d}" for m in SHARED | OPS for d in local(m) & (FORWARD | BACKWARD)]
    bad += [f"common imports {d}" for d in local("common") - {"common"}]  # the bottom layer
    assert not bad, bad
    fwd_deps = set().union(*(local(m) for m in FORWARD)) - FORWARD
    bwd_deps = set().union(*(local(m) for m in BACKWARD)) - BACKWARD
    assert fwd_deps & bwd_deps <= SHARED, f"forward and backward both import {fwd_deps & bwd_deps - SHARED}"


def test_no_import_cycle():
    """Depth-first search over k3kernels/'s import graph (function-level imports included)."""
    state, cycles = {}, []

    def visit(n, stack):
        state[n] = "open"
        for d in sorted(GRAPH[n]):
            if state.get(d) == "open":
                cycles.append(" -> ".join([*stack[stack.index(d):], d]))
            elif d not in state:
                visit(d, [*stack, d])
        state[n] = "done"

    for n in sorted(MODULES):
        if n not in state:
            visit(n, [n])
    assert not cycles, cycles


def test_triton_is_imported_at_module_level_only_by_triton_modules():
    bad = [f"{n} imports {m}" for n in MODULES for m, top in imports(n)
           if top and (m == "triton" or m.startswith(("triton.", KDA_TRITON))) and "triton" not in n]
    assert not bad, bad


def test_kernels_import_nothing_built_on_them():
    bad = [f"{n} imports {m}" for n in MODULES for m, _ in imports(n) if m.startswith(FORBIDDEN)]
    assert not bad, bad


def test_only_config_and_dispatch_read_the_environment():
    """The kernels read their settings from the applied KernelConfig (dispatch.active_config); os.environ and
    os.getenv appear only in k3kernels/config.py and k3kernels/dispatch.py."""
    bad = []
    for name, path in MODULES.items():
        if name in (f"{PACKAGE}.config", f"{PACKAGE}.dispatch"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
                bad.append(f"{name}: os.{node.attr} (line {node.lineno})")
    assert not bad, bad
