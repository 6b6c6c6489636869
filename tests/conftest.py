"""Shared test setup: seed 42, NaN-poisoned torch.empty (reads of unwritten memory fail), device markers."""

import os

# OpenMP's default spin-wait makes 2-thread torch 10-20x slower whenever another process shares the 2 cores
# (measured here); passive waiting costs nothing measurable when the machine is idle. Set before torch loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("K3_KERNELS", "torch")

import pytest
import torch

_real_empty = torch.empty


def _poisoned_empty(*args, **kwargs):
    if torch.compiler.is_compiling():
        # traced, the fill is a copy_ into a fresh buffer that inductor's check of functional graphs rejects when the
        # buffer then goes to a Triton kernel as a mutated argument (AssertionError "n=copy_, n.args[0]=empty", H200
        # 2026-11-29 and 2026-11-30); compiled code allocates as it would outside the tests
        return _real_empty(*args, **kwargs)
    t = _real_empty(*args, **kwargs)
    if t.is_floating_point() and t.numel() > 0:
        # a leaf that requires grad (torch.empty(..., requires_grad=True), as inductor's pad_mm pattern setup calls
        # it under torch.compile) takes an in-place fill only outside autograd
        with torch.no_grad():
            t.fill_(float("nan"))
    return t




@pytest.fixture(autouse=True)
def _seed_and_poison(monkeypatch):
    torch.manual_seed(42)
    monkeypatch.setattr(torch, "empty", _poisoned_empty)
    yield


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU")
    config.addinivalue_line("markers", "slow: longer CPU test (still run in CI)")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
