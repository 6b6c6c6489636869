"""`k3 export-hf`: a release directory that transformers loads with `trust_remote_code=True` where k3 is not installed.

Design. The modeling code in the exported directory is generated from the installed k3 package, never written by
hand: `export_hf` starts at k3.model.hf (the K3Config / K3ForCausalLM that `import k3.model.hf` registers), follows
every import of k3.model and k3.kernels it reaches (module level and inside functions, read from the source with
`ast`), and embeds those source files verbatim in one generated module, DIR/modeling_k3.py. The Triton modules are
left out (a name component starting with "triton", or an import of `triton`): the export runs k3's PyTorch kernels,
on the CPU or a GPU. The only change to the sources is the package name in their k3 imports: `k3.model` and
`k3.kernels` become a private package `k3_hf_<digest of the sources>`, so the export never collides with an
installed k3 or with another export of different code. modeling_k3.py installs an import hook that serves that
package from the embedded sources, clears the copied kernel registry's Triton entries (so "auto" resolves to the
PyTorch kernels and an explicit K3_KERNELS=triton fails with k3's own message), and exposes K3Config and
K3ForCausalLM; config.json's `auto_map` points at them. One file, because transformers copies only the module named
in auto_map (and flat relative imports) into its module cache, locally and from the Hub alike.

The weights, config.json's k3 fields, the generation config, tokenizer files and k3_run.yaml are the release's
files, copied unchanged (config.json gains `auto_map`), so k3 itself still loads the exported directory.

Quantized releases are refused: their quantization_config (quant_method "k3") names no quantizer transformers
knows, so transformers' own loading (AutoHfQuantizer) and the tools built on it reject the directory, although the
embedded k3 loader would read it; export the bf16 / fp32 release the quantized one was made from.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import re
import shutil
import sys
import textwrap
import uuid
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml

from .checkpoint import SAFETENSORS_INDEX, TOKENIZER_FILES, read_quantization_config, replace_dir, write_text
from .config import CheckpointError

ENTRY_MODULE = "modeling_k3"
AUTO_MAP = {"AutoConfig": f"{ENTRY_MODULE}.K3Config", "AutoModelForCausalLM": f"{ENTRY_MODULE}.K3ForCausalLM"}
ROOT_MODULE = "k3.model.hf"
EMBEDDED_PACKAGES = ("k3.model", "k3.kernels")  # what the modeling code may import from k3 (dependencies run one way)
_COPIED_FILES = ("model.safetensors", SAFETENSORS_INDEX, "generation_config.json", *TOKENIZER_FILES, "k3_run.yaml")


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{package} is not an importable package; reinstall k3 (pip install -e .)")
    return Path(next(iter(spec.submodule_search_locations)))


def _source_file(name: str, roots: dict[str, Path]) -> tuple[Path, bool] | None:
    """(file, is_package) of dotted module `name` under one of the embedded packages, or None if it is not one."""
    for pkg, root in roots.items():
        if name == pkg:
            return root / "__init__.py", True
        if name.startswith(pkg + "."):
            base = root.joinpath(*name[len(pkg) + 1:].split("."))
            if (base / "__init__.py").is_file():
                return base / "__init__.py", True
            if base.with_suffix(".py").is_file():
                return base.with_suffix(".py"), False
            return None
    return None


def _imports(name: str, is_package: bool, tree: ast.AST) -> set[str]:
    """Every dotted name an import statement of module `name` may load (`from a import b` may be module a.b)."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _is_triton(name: str, tree: ast.AST) -> bool:
    if any(part.startswith("triton") for part in name.split(".")):
        return True
    return any(n == "triton" or n.startswith("triton.") for n in _imports(name, False, tree))


def collect_sources() -> tuple[dict[str, tuple[bool, str]], set[str]]:
    """The k3 modules the HF classes need: ({dotted name: (is_package, source)}, third-party top-level imports)."""
    roots = {pkg: _package_dir(pkg) for pkg in EMBEDDED_PACKAGES}
    found: dict[str, tuple[bool, str]] = {}
    third_party: set[str] = set()
    todo = [ROOT_MODULE]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        where = _source_file(name, roots)
        if where is None:
            continue
        path, is_package = where
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
        if _is_triton(name, tree):
            continue
        found[name] = (is_package, source)
        parent = name.rpartition(".")[0]
        if parent in EMBEDDED_PACKAGES or any(parent.startswith(p + ".") for p in EMBEDDED_PACKAGES):
            todo.append(parent)  # importing a submodule imports its packages first
        for imp in _imports(name, is_package, tree):
            if imp.startswith("k3."):
                todo.append(imp)
            elif imp.split(".")[0] not in sys.stdlib_module_names and imp != "__future__":
                third_party.add(imp.split(".")[0])
    return found, third_party


_K3_IMPORT = re.compile(r"^(\s*(?:from|import)\s+)k3\.(model|kernels)\b", re.MULTILINE)


def rewrite_imports(source: str, package: str) -> str:
    """`from k3.model.x import y` -> `from PACKAGE.model.x import y`, on the first lines of import statements only
    (docstrings that show `import k3.model.hf` stay as they are)."""
    starts = {n.lineno - 1 for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom))}
    lines = source.splitlines(keepends=True)
    for i in starts:
        lines[i] = _K3_IMPORT.sub(lambda m: f"{m.group(1)}{package}.{m.group(2)}", lines[i])
    out = "".join(lines)
    absolute = [a.name for n in ast.walk(ast.parse(out)) if isinstance(n, ast.Import) for a in n.names]
    absolute += [n.module for n in ast.walk(ast.parse(out)) if isinstance(n, ast.ImportFrom) and not n.level]
    left = [n for n in absolute if n == "k3" or n.startswith("k3.")]
    if left:  # an import form the rewrite does not know; the export would need k3 installed
        raise RuntimeError(f"k3 export-hf cannot rename the imports {sorted(left)}; write them as `from k3.model... "
                           "import ...` / `from k3.kernels... import ...`")
    return out


def _k3_version() -> str:
    try:
        return version("k3")
    except PackageNotFoundError:
        return "unknown"


def modeling_source() -> str:
    """The text of the generated modeling_k3.py (module docstring of this file)."""
    sources, third_party = collect_sources()
    digest = hashlib.sha256(json.dumps(sorted(sources.items())).encode()).hexdigest()[:12]
    package = f"k3_hf_{digest}"
    embedded = {name.removeprefix("k3."): (is_pkg, rewrite_imports(src, package))
                for name, (is_pkg, src) in sorted(sources.items())}
    body = ",\n".join(f"    {name!r}: ({is_pkg!r}, {src!r})" for name, (is_pkg, src) in embedded.items())
    needs = ", ".join(sorted(third_party | {"transformers"}))
    listing = textwrap.fill(", ".join(embedded), width=116)
    return f'''"""K3 model code for transformers (trust_remote_code=True), generated by `k3 export-hf` from k3
{_k3_version()}.

Do not edit: regenerate with `k3 export-hf CKPT --out DIR`. The k3 modules below are k3's own source files,
embedded verbatim except that their k3 imports name the private package {package}; an import hook
serves that package from them. Imports needed: {needs}. Modules:
{listing}
"""

import importlib
import importlib.abc
import importlib.util
import linecache
import sys

PACKAGE = {package!r}
SOURCES = {{  # module under PACKAGE -> (is a package, source)
{body},
}}


class _EmbeddedSources(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads PACKAGE and its modules from SOURCES."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == PACKAGE:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        if fullname.startswith(PACKAGE + ".") and fullname[len(PACKAGE) + 1:] in SOURCES:
            return importlib.util.spec_from_loader(fullname, self, is_package=SOURCES[fullname[len(PACKAGE) + 1:]][0])
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == PACKAGE:
            return
        source = SOURCES[module.__name__[len(PACKAGE) + 1:]][1]
        filename = f"<{{module.__name__}} (k3 export-hf)>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # readable tracebacks
        exec(compile(source, filename, "exec"), module.__dict__)

    package = PACKAGE


# transformers may execute this file more than once: one hook per package
if not any(getattr(f, "package", None) == PACKAGE for f in sys.meta_path):
    sys.meta_path.insert(0, _EmbeddedSources())

# only the PyTorch kernels are embedded: with no Triton entries, "auto" picks them and "triton" fails with k3's message
importlib.import_module(PACKAGE + ".kernels.dispatch").TRITON_OPS.clear()
_hf = importlib.import_module(PACKAGE + ".model.hf")
K3Config = _hf.K3Config
K3ForCausalLM = _hf.K3ForCausalLM
'''


def _quantized_error(ckpt: Path, qc: dict) -> CheckpointError:
    parent = None
    run = ckpt / "k3_run.yaml"
    if run.is_file():
        try:
            parent = (yaml.safe_load(run.read_text(encoding="utf-8")) or {}).get("parent_checkpoint")
        except yaml.YAMLError:
            parent = None
    fix = f"k3 export-hf {parent} --out DIR" if parent else "k3 export-hf BF16_RELEASE --out DIR"
    return CheckpointError(f"{ckpt} is a quantized release (config.json quantization_config, quant_method "
                           f"{qc.get('quant_method')!r}, format {qc.get('format')!r}): no quantizer transformers "
                           f"knows, so transformers' own loading and the tools built on it reject it; export the "
                           f"bf16 / fp32 release it was made from instead: {fix}")


def export_hf(ckpt: str | Path, out: str | Path) -> Path:
    """Write the release `ckpt` to `out` as a transformers directory with generated remote code; returns `out`.

    `out` must not exist, be empty, or be an earlier export (it is replaced atomically). Raises CheckpointError for
    a missing / invalid / quantized release or an unusable `out`.

    Example: export_hf("runs/tiny/final", "runs/tiny/hf")
    """
    ckpt, out = Path(ckpt), Path(out)
    qc = read_quantization_config(ckpt)  # validates the directory and config.json, with k3's messages
    if qc is not None:
        raise _quantized_error(ckpt, qc)
    if out.resolve() == ckpt.resolve():
        raise CheckpointError(f"--out {out} is the checkpoint itself; choose a new directory")
    if out.exists():
        if not out.is_dir():
            raise CheckpointError(f"{out} exists and is not a directory; choose another --out")
        if any(out.iterdir()) and not (out / f"{ENTRY_MODULE}.py").is_file():
            raise CheckpointError(f"{out} is a non-empty directory that is not a k3 export-hf output; choose a new "
                                  "--out (an earlier export is replaced, anything else is left alone)")
    config = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    config["auto_map"] = dict(AUTO_MAP)
    code = modeling_source()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write_text(tmp / "config.json", json.dumps(config, indent=2) + "\n")
        names = [*_COPIED_FILES]
        index = ckpt / SAFETENSORS_INDEX
        if index.is_file():
            names += sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        for name in names:
            if (ckpt / name).is_file():
                shutil.copyfile(ckpt / name, tmp / name)
        write_text(tmp / f"{ENTRY_MODULE}.py", code)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
