"""Shared test setup: seed 42, NaN-poisoned torch.empty (reads of unwritten memory fail), device markers, threads a
pytest-xdist worker."""

import os

# OpenMP's default spin-wait makes 2-thread torch 10-20x slower whenever another process shares the 2 cores
# (measured here); passive waiting costs nothing measurable when the machine is idle. Set before torch loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("K3_KERNELS", "torch")
# under pytest-xdist (-n N) the N workers share the cores: each worker (and the processes its tests start) takes its
# share of threads, so that two workers on 2 cores do not each run 2 threads and wait on each other's core
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import pytest
import torch

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch first

_real_empty = torch.empty


def _poisoned_empty(*args, **kwargs):
    t = _real_empty(*args, **kwargs)
    if not t.is_floating_point() or t.numel() == 0 or "out" in kwargs or kwargs.get("pin_memory"):
        return t
    # a new NaN tensor like t, not an in-place fill of t: traced by torch.compile, a fill of a fresh buffer became
    # copy_(empty, full) in the graph, which inductor's check of functional graphs rejects (AssertionError "n=copy_,
    # n.args[0]=empty", H200 2026-11-29 and 2026-11-30, torch 2.11); and a leaf that requires grad (inductor's
    # pad_mm setup allocates some) takes no in-place op under autograd
    return torch.full_like(t, float("nan"), requires_grad=t.requires_grad)


# the real allocation, for the GPU tests that compile with inductor (test_decode_compile, test_kda_triton): inductor
# failed on the poisoned one there in both forms (the fill's copy_, then full_like: KeyError 'op4', H200 2026-11-30)
_poisoned_empty.real = _real_empty


@pytest.fixture(autouse=True)
def _seed_and_poison(monkeypatch):
    torch.manual_seed(42)
    monkeypatch.setattr(torch, "empty", _poisoned_empty)
    yield


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU")
    config.addinivalue_line("markers", "slow: longer CPU test (still run in CI)")
    config.addinivalue_line("markers", "slow_compile: every variant of a GPU compile check (minutes with an empty "
                                       "Triton cache); skipped unless -m names slow_compile "
                                       "(benchmarks/gpu.sh kernels runs them)")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    # the README's test command runs the covering subset of each compile check; all of them on request
    if "slow_compile" not in (config.getoption("markexpr") or ""):
        skip = pytest.mark.skip(reason="every compile variant: python -m pytest -m slow_compile tests/kernels")
        for item in items:
            if "slow_compile" in item.keywords:
                item.add_marker(skip)
