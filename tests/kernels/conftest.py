"""Triton kernels on a CPU: import triton and every Triton kernel module under the interpreter, once.

Triton decides at import time whether @triton.jit functions (its own tl.* helpers included) are interpreted, so on a
CPU this conftest (loaded while collecting tests/kernels, before its test modules) imports them with
TRITON_INTERPRET=1 and then restores the environment; the autouse fixtures of the Triton test files set it again per
test. Without triton installed nothing happens and those files skip themselves.
"""

import importlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

TRITON_MODULES = tuple(f"k3.kernels.kda.triton.{m}" for m in (
    "common", "launch", "norm", "gate", "recurrent", "intra_fwd", "solve", "segments", "chunk_fwd", "intra_bwd",
    "chunk_bwd")) + ("k3.kernels.glu.triton", "k3.kernels.moe.triton_router", "k3.kernels.mla.triton_decode",
                     "k3.kernels.mla.triton_max_logit",
                     "k3.kernels.quant.triton", "k3.kernels.conv.triton", "k3.kernels.norm.triton",
                     "k3.kernels.loss.triton", "k3.kernels.moe.triton_combine")


def _import_for_the_interpreter() -> None:
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.zeros, InterpretedFunction):
            raise RuntimeError(  # noqa: TRY004 - a setup-order problem, not a bad argument type
                "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on "
                "the CPU; run tests/kernels on their own or set TRITON_INTERPRET=1")
        for name in TRITON_MODULES:
            importlib.import_module(name)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    _import_for_the_interpreter()


@pytest.fixture
def single_thread():
    """Tiny tensors: one intra-op thread is faster, and immune to OpenMP spin-waits on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def triton_cpu(monkeypatch, single_thread):
    """Triton kernels on a CPU: TRITON_INTERPRET=1 for the test (restored after); nothing on a CUDA machine."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def kernel_config_restored():
    """Each test starts as a process that never called k3.kernels.configure (the environment, as the test sets it,
    decides at its first kernel call) and leaves the kernel config as it found it."""
    from k3.kernels import dispatch

    saved = dispatch._CONFIG
    dispatch._CONFIG = None
    dispatch.kernel_backend.cache_clear()
    yield
    dispatch._CONFIG = saved
    dispatch.kernel_backend.cache_clear()


@pytest.fixture
def kernel_env(monkeypatch):
    """set(VAR=value, ...): kernel environment variables (K3_KERNELS, K3_KDA_*; None unsets one) for the rest of the
    test, applied as in a process started with them: the config is forgotten, so the next kernel call reads them
    (dispatch.active_config). Restored after the test (monkeypatch, kernel_config_restored)."""
    from k3.kernels import dispatch

    def set_env(**env):
        for var, value in env.items():
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, value)
        dispatch._CONFIG = None
        dispatch.kernel_backend.cache_clear()

    return set_env


@pytest.fixture
def triton_kda_backward(kernel_env, triton_cpu):
    """The Triton kernels with the Triton KDA backward (K3_KERNELS=triton, K3_KDA_BWD=triton) for one test."""
    kernel_env(K3_KERNELS="triton", K3_KDA_BWD="triton")


@pytest.fixture
def launch_spy(monkeypatch):
    """spy(module, name): replace kernel `name` of `module` by a wrapper that records each launch's grid, then
    launches it; returns the list the grids go to (restored after the test). The wrapper keeps the kernel's
    __name__: common.launch_fitting keys refused launches by it."""
    def spy(module, name):
        grids, real = [], getattr(module, name)
        monkeypatch.setattr(module, name, type("Spy", (), {"__name__": name, "__getitem__": lambda _, grid: (
            grids.append(grid), real[grid])[1]})())
        return grids

    return spy


@pytest.fixture
def launch_kwargs(monkeypatch):
    """spy(module, name, keys): replace kernel `name` of `module` by a wrapper that records, per launch, the tuple of
    the given launch keywords (None for one not passed: e.g. `maxnreg` where no register cap is set), then launches
    it; returns the list the tuples go to (restored after the test)."""
    def spy(module, name, keys):
        seen, real = [], getattr(module, name)

        def launcher(grid):
            def launch(*args, **kw):
                seen.append(tuple(kw.get(k) for k in keys))
                return real[grid](*args, **kw)
            return launch

        monkeypatch.setattr(module, name, type("Spy", (), {"__name__": name,
                                                           "__getitem__": lambda _, grid: launcher(grid)})())
        return seen

    return spy


@pytest.fixture
def bf16_dots(monkeypatch):
    """tl.dot of bf16 operands under Triton's interpreter as a GPU computes it: the operands' bf16 values widened to
    fp32 (exact: a bf16 is an fp32's top 16 bits), then an fp32 matmul. Triton 3.6's interpreter keeps bf16 tensors
    as uint16 bit patterns and multiplies those (triton-lang/triton#11584, ~1e10 off at 16 x 16). Opt-in, for tests
    that run bf16 kernels on a CPU; the interpreter's fp32 -> bf16 casts still truncate where a GPU rounds to
    nearest, so such tests need bf16 thresholds a little above the GPU's."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    real = interpreter.InterpreterBuilder.create_dot

    def widened(x):  # [.., ..] uint16 bf16 bit patterns -> the same values in fp32
        return (x.data.astype(np.uint32) << 16).view(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return real(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data = widened(a) if a.dtype.scalar == tl.bfloat16 else a.data.astype(np.float32)
        b_data = widened(b) if b.dtype.scalar == tl.bfloat16 else b.data.astype(np.float32)
        return interpreter.TensorHandle(np.matmul(a_data, b_data, dtype=np.float32) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture
def bounds_check(monkeypatch):
    """Out-of-bounds accesses of interpreted kernels: every load and store whose mask is set must fall inside the
    storage of one of the launch's tensor arguments. Yields the list of offences, (kernel, "load" / "store", the
    first bad addresses), for the test to assert empty. A GPU faults on such an access (an illegal address) or
    reads garbage, the interpreter reads whatever host memory lies there. Opt-in (it costs a check per access)."""
    import numpy as np
    from triton.runtime import interpreter

    ranges, offences = [], []  # ranges: (first byte, end byte) of the current launch's argument storages
    real_init = interpreter.GridExecutor._init_args_hst
    real_load = interpreter.InterpreterBuilder.create_masked_load
    real_store = interpreter.InterpreterBuilder.create_masked_store
    kernel = [""]

    def init(self, args_dev, kwargs):
        args_hst, kwargs_hst = real_init(self, args_dev, kwargs)
        ranges.clear()
        kernel[0] = getattr(self.fn, "__name__", "?")
        for a in (*args_hst, *kwargs_hst.values()):
            if hasattr(a, "untyped_storage"):
                st = a.untyped_storage()
                ranges.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        return args_hst, kwargs_hst

    def check(ptrs, mask, what):
        p = ptrs.data[mask.data].reshape(-1).astype(np.uint64)
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        ok = np.zeros(p.shape, dtype=bool)
        for lo, hi in ranges:
            ok |= (p >= lo) & (p + size <= hi)
        if not ok.all():
            offences.append((kernel[0], what, [hex(int(x)) for x in p[~ok][:3]]))

    def load(self, ptrs, mask, other, *rest):
        check(ptrs, mask, "load")
        return real_load(self, ptrs, mask, other, *rest)

    def store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, "store")
        return real_store(self, ptrs, value, mask, *rest)

    monkeypatch.setattr(interpreter.GridExecutor, "_init_args_hst", init)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", load)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_store", store)
    yield offences


@pytest.fixture(autouse=True)
def bounds_everywhere(request):
    """K3_TEST_BOUNDS=1: bounds_check around every test that runs interpreted kernels (slower), failing a test whose
    kernels loaded or stored outside their launches' tensors. Unset: nothing (the tests that ask for bounds_check
    themselves still check)."""
    if os.environ.get("K3_TEST_BOUNDS", "0") in ("", "0") or "bounds_check" in request.fixturenames \
            or torch.cuda.is_available():
        yield
        return
    offences = request.getfixturevalue("bounds_check")
    yield
    assert offences == [], f"out-of-bounds accesses (kernel, kind, addresses): {offences[:3]}"


@pytest.fixture(autouse=True)
def masks_are_bool(monkeypatch):
    """Every interpreted load and store takes a bool mask, else the test fails (a check only: the accesses run as
    they would). A block mask combined with a scalar comparison, `m & (slot >= 0)`, reaches Triton 3.6-3.8's
    interpreter as an int32 mask, which they take and Triton 3.9's refuses ("mask has unsupported dtype"), so this
    fails such a kernel under every version the tests run on. Nothing on a CUDA machine or without triton."""
    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        yield
        return
    from triton.runtime import interpreter

    offences = []  # (load / store, the mask's numpy dtype)
    real_load = interpreter.InterpreterBuilder.create_masked_load
    real_store = interpreter.InterpreterBuilder.create_masked_store

    def load(self, ptrs, mask, *rest):
        if mask.data.dtype != bool:
            offences.append(("load", str(mask.data.dtype)))
        return real_load(self, ptrs, mask, *rest)

    def store(self, ptrs, value, mask, *rest):
        if mask.data.dtype != bool:
            offences.append(("store", str(mask.data.dtype)))
        return real_store(self, ptrs, value, mask, *rest)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", load)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_store", store)
    yield
    assert offences == [], f"interpreted loads / stores with a mask that is not bool (kind, dtype): {offences[:3]}"


def compile_shards() -> int:
    """Compile processes for one sm90_compile call: a core each, at most 8. Under pytest-xdist (-n N) the other
    workers run tests meanwhile, so each call gets its share of the cores (2 cores, -n 2: one process), not all."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(8, len(os.sched_getaffinity(0)) // max(1, workers)))


@pytest.fixture
def sm90_compile(tmp_path):
    """run(script, mode, timeout): compile for sm_90 the kernel variants that `script` declares (sm90_compile.py: mode
    "cover", a subset that still gives every value of every kernel's variants, or "every"), in one process a core
    (at most 8; under pytest-xdist the cores are split between its workers) without the interpreter, all within
    `timeout` seconds; fails with a failed process's output or where the processes together compiled none (or, in
    mode "every", not all), else returns how many they compiled."""
    def run(script: str, mode: str, timeout: float) -> int:
        (tmp_path / "variants.py").write_text(script)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        shards = compile_shards()
        logs = [tmp_path / f"shard{i}.log" for i in range(shards)]
        procs = []
        for i, log in enumerate(logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).with_name("sm90_compile.py")), str(tmp_path / "variants.py"),
                     mode, str(i), str(shards)], stdout=out, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        compiled = 0
        for p, log in zip(procs, logs):
            text = log.read_text()
            assert p.returncode == 0 and "compiled " in text, text[-3000:]
            n, _, total = text.rsplit("compiled ", 1)[1].split()[:3]  # "compiled N of M"
            compiled += int(n)
        assert compiled == int(total) if mode == "every" else 0 < compiled <= int(total), (compiled, total)
        return compiled

    return run


@pytest.fixture(autouse=True, scope="session")
def kda_launch_overrides():
    """K3_TEST_KDA_LAUNCH="NAME.KEY=VALUE,...": LAUNCH entries of the KDA chunk kernels (triton/launch.py, as
    benchmarks/kda_tune.py --set takes them) for the whole test run, so that the GPU tests can run a candidate launch
    before it ships. Unset: nothing changes."""
    raw = os.environ.get("K3_TEST_KDA_LAUNCH", "").strip()
    if not raw:
        yield
        return
    from k3.kernels.kda.triton.launch import set_launch_entry

    saved = [set_launch_entry(item) for item in raw.split(",")]  # ValueError names the known entries
    yield
    for table, key, old in reversed(saved):
        table[key] = old
