"""Compile Triton kernels for the GPU (sm_90: Triton's front end, its LLVM back end and ptxas) without a GPU, in a
process without the interpreter: the harness of test_kda_compile.py and test_kda_recurrent_compile.py (through
conftest's `sm90_compile` fixture).

`python sm90_compile.py SCRIPT MODE SHARD SHARDS`: SCRIPT (a Python file) calls
`variant(fn, signature, constexprs, options, attrs=None, check=None)` once per kernel variant; nothing compiles while
it runs. MODE `every` then compiles every variant; `cover` a subset in which each value that some variant of a kernel
gives a constexpr, an argument's type or a launch option is still given by one compiled variant of that kernel
(greedy: the variant that covers the most values not yet covered first, the earliest of equals). Process SHARD of
SHARDS compiles selected variants SHARD, SHARD + SHARDS, ... (the processes run side by side, one a core). `check`,
if given, is called with the PTX. Prints "compiled N of M" at the end; a failed compile or check raises.
"""

import runpy
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

VARIANTS = []  # (fn, signature, constexprs, options, attrs, check)


def variant(fn, signature, constexprs, options, attrs=None, check=None):
    VARIANTS.append((fn, signature, constexprs, options, attrs, check))


def values(v) -> set:
    """What variant v sets, each value keyed by its kernel."""
    fn, signature, constexprs, options, _, _ = v
    name = fn.__name__
    return ({(name, "const", k, repr(x)) for k, x in constexprs.items()}
            | {(name, "arg", a, t) for a, t in signature.items() if t != "constexpr"}
            | {(name, "option", k, repr(x)) for k, x in options.items()})


def cover(variants) -> list[int]:
    """Indices (in order) of a subset of variants that gives every value some variant gives (values)."""
    sets = [values(v) for v in variants]
    left = set().union(*sets) if sets else set()
    chosen = []
    while left:
        best = max(range(len(sets)), key=lambda i: len(sets[i] & left))
        chosen.append(best)
        left -= sets[best]
    return sorted(chosen)


def compile_variant(v) -> None:
    fn, signature, constexprs, options, attrs, check = v
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): x for k, x in constexprs.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    assert f".entry {fn.__name__}" in ptx, fn.__name__
    if check is not None:
        check(ptx)


def main() -> None:
    script, mode, shard, shards = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    runpy.run_path(script, init_globals={"variant": variant})
    picked = range(len(VARIANTS)) if mode == "every" else cover(VARIANTS)
    mine = list(picked)[shard::shards]
    for i in mine:
        compile_variant(VARIANTS[i])
    print(f"compiled {len(mine)} of {len(VARIANTS)}")


if __name__ == "__main__":
    main()
