"""Kernel backend selection: "torch" (plain PyTorch, runs everywhere) or "triton" (GPU kernels), and the process's
KernelConfig (config.py).

`configure(cfg)` applies a KernelConfig for the process; its fields' environment variables override it (read at that
call). When configure is never called, the first kernel call applies `KernelConfig()` with the same overrides, so
the variables alone select as they always did. The backend (`KernelConfig.backend`, overridden by `K3_KERNELS`):

    torch    always the PyTorch implementations
    triton   the Triton kernels for CUDA tensors; an error if they are not available (no silent fallback)
    auto     (K3_KERNELS unset or empty) triton when a CUDA GPU is present and `triton` imports, torch otherwise

"triton" without a GPU is allowed only under Triton's CPU interpreter (`TRITON_INTERPRET=1`, slow; used by the CPU
tests); otherwise asking for it raises KernelBackendError naming the fix.

Public ops (`chunk_kda`, `fused_recurrent_kda`, ...) call `resolve(op_name, torch_impl, like=x)` to get the callable
for the chosen backend and the device of their input `x`: a Triton kernel gets CUDA tensors only (CPU tensors under
the interpreter), so a CPU tensor in a process with a GPU (a CPU model or reference next to the GPU one) runs the
PyTorch twin on either backend. A Triton implementation is made available by adding `op_name -> "module:function"` to
`TRITON_OPS`; ops without an entry use their PyTorch implementation on either backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Callable

import torch

from .config import ENV_VARS, KernelConfig, with_env_overrides

ENV_VAR = ENV_VARS["backend"]
BACKENDS = ("torch", "triton")

# op name -> "importable.module:function" of its Triton implementation (imported lazily, on first use).
TRITON_OPS: dict[str, str] = {
    "fused_recurrent_kda": "k3.kernels.kda.triton.recurrent:fused_recurrent_kda_triton",
    "chunk_kda": "k3.kernels.kda.chunk:chunk_kda_triton",
    "c2_glu": "k3.kernels.glu.triton:c2_glu_dispatch",
    "c2_glu_packed": "k3.kernels.glu.triton:c2_glu_packed_dispatch",
    "causal_conv1d": "k3.kernels.conv.triton:causal_conv1d_triton",
    "causal_conv1d_multi": "k3.kernels.conv.triton:causal_conv1d_multi_triton",
    "gated_rms_norm": "k3.kernels.norm.triton:gated_rms_norm_triton",
    "rms_norm": "k3.kernels.norm.triton:rms_norm_triton",
    "softmax_rows": "k3.kernels.loss.triton:softmax_rows_triton",
    "moe_unpermute": "k3.kernels.moe.triton_combine:moe_unpermute_triton",
    "paged_mla_decode": "k3.kernels.mla.triton_decode:paged_mla_decode_triton",
    "causal_max_logit": "k3.kernels.mla.triton_max_logit:causal_max_logit_triton",
    "quant_grouped_mm": "k3.kernels.quant.triton:quant_grouped_mm_triton",
    "quant_linear": "k3.kernels.quant.triton:quant_linear_triton",
    "attn_res_mix": "k3.kernels.attnres.triton:attn_res_mix_dispatch",
}

log = logging.getLogger("k3.kernels")


class KernelBackendError(RuntimeError):
    """The requested kernel backend cannot be used; the message says why and how to pick another."""


def triton_interpreter() -> bool:
    """True when TRITON_INTERPRET is set (Triton then runs kernels on the CPU, in Python)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")


def triton_kernels_available() -> bool:
    """True when Triton kernels are registered, the `triton` package imports, and a CUDA device is present."""
    if not TRITON_OPS:
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available()


def parse_backend(value: str | None) -> str:
    """Map a backend setting (KernelConfig.backend or a `K3_KERNELS` value; None, "" and "auto" mean auto) to
    "torch" | "triton" (pure function; `kernel_backend` caches its result)."""
    if value is None or not value.strip() or value.strip().lower() == "auto":
        return "triton" if triton_kernels_available() else "torch"
    v = value.strip().lower()
    if v == "torch":
        return "torch"
    if v == "triton":
        if not TRITON_OPS:
            raise KernelBackendError(
                f"the triton backend was requested ({ENV_VAR}=triton or KernelConfig.backend), but the Triton KDA "
                f"kernels are not available in this build "
                f"(no Triton kernels are registered in k3.kernels.dispatch.TRITON_OPS). "
                f"Set {ENV_VAR}=torch or KernelConfig(backend='torch') to use the PyTorch kernels."
            )
        has_triton = importlib.util.find_spec("triton") is not None
        if not (has_triton and (torch.cuda.is_available() or triton_interpreter())):
            raise KernelBackendError(
                f"the triton backend was requested ({ENV_VAR}=triton or KernelConfig.backend), but the Triton KDA "
                f"kernels are not available here: they need the "
                f"`triton` package (installed: {has_triton}) and a CUDA GPU (available: {torch.cuda.is_available()}),"
                f" or TRITON_INTERPRET=1 to run them on the CPU under Triton's interpreter. "
                f"Set {ENV_VAR}=torch or KernelConfig(backend='torch') to use the PyTorch kernels."
            )
        return "triton"
    raise KernelBackendError(f"{value!r} is not a kernel backend; use {ENV_VAR}=torch or {ENV_VAR}=triton")


# (effective config, the environment overrides that applied): set by configure; None until then
_CONFIG: tuple[KernelConfig, dict[str, str]] | None = None


def configure(cfg: KernelConfig) -> tuple[KernelConfig, dict[str, str]]:
    """Apply `cfg` to the kernels of this process, each field overridden by its environment variable where that is
    set (config.ENV_VARS, read now). Returns (the effective config, {variable: value} of the overrides that applied),
    for the caller to record. ValueError names a bad field or variable; nothing changes then. A later call replaces
    the config and forgets the backend resolved under the previous one."""
    global _CONFIG
    effective, overrides = with_env_overrides(cfg)
    _CONFIG = (effective, overrides)
    kernel_backend.cache_clear()
    log.info("k3 kernels: %s (environment overrides: %s)", effective, overrides or "none")
    return effective, dict(overrides)


def active_config() -> KernelConfig:
    """The config the kernels run with: the configured one, or on first use without configure
    `configure(KernelConfig())` (the defaults with the environment's overrides)."""
    if _CONFIG is None:
        configure(KernelConfig())
    return _CONFIG[0]


@functools.cache
def kernel_backend() -> str:
    """The process-wide backend, "torch" or "triton", resolved once from active_config().backend (module
    docstring); configure() resolves it again."""
    cfg = active_config()
    backend = parse_backend(cfg.backend)
    log.info("k3 kernels: backend=%s (KernelConfig.backend=%r)", backend, cfg.backend)
    return backend


def resolve(op: str, torch_impl: Callable, like: torch.Tensor | None = None) -> Callable:
    """The implementation of `op` for the chosen backend; ops without a Triton version use `torch_impl`, and so do
    inputs `like` that are not on a CUDA device (outside the interpreter): the Triton kernels run on CUDA tensors only.
    """
    if kernel_backend() == "torch" or op not in TRITON_OPS:
        return torch_impl
    if like is not None and not like.is_cuda and not triton_interpreter():
        return torch_impl
    module, name = TRITON_OPS[op].split(":")
    return getattr(importlib.import_module(module), name)


def check_device(fn: str, *tensors) -> None:
    """Triton kernels need CUDA tensors, or CPU tensors under the interpreter; say so instead of crashing inside."""
    for t in tensors:
        if t is None:
            continue
        if t.is_cuda and triton_interpreter():
            raise RuntimeError(f"{fn}: TRITON_INTERPRET=1 runs Triton kernels on the CPU, but got a CUDA tensor; "
                               f"unset TRITON_INTERPRET or move the inputs to the CPU")
        if not t.is_cuda and not triton_interpreter():
            raise RuntimeError(f"{fn}: the Triton kernels need CUDA tensors, got a {t.device} tensor; move the inputs "
                               f"to the GPU, set K3_KERNELS=torch, or TRITON_INTERPRET=1 to interpret them on the CPU")


_TRUSTED = contextvars.ContextVar("k3_kernels_trusted_inputs", default=False)


@contextlib.contextmanager
def trusted_inputs():
    """Within this block the Triton wrappers skip the argument checks that read tensor VALUES on the host (slot
    ranges, distinct slots, sequence lengths): each such read waits for the GPU queue. For callers that validated
    those values on the host already (the serving engine); shapes and dtypes are still checked."""
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def inputs_trusted() -> bool:
    """True inside `trusted_inputs()`."""
    return _TRUSTED.get()
