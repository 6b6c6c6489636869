"""The kernel core's settings (`KernelConfig`), standard library only, and their environment overrides.

A process applies one KernelConfig with `k3.kernels.configure(cfg)` (dispatch.py holds it). Each field has an
environment variable that overrides it when set to a non-empty value, so a run can change a setting without touching
its config file; `with_env_overrides` reports which ones applied, for the caller to record next to the config.
When configure is never called, the defaults below with the same overrides apply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

BACKENDS = ("auto", "torch", "triton")
KDA_BACKWARDS = ("triton", "torch")
FP32_DOT_PRECISIONS = ("ieee", "tf32x3", "tf32")  # the order the error messages list them in
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(kw_only=True, slots=True)
class KernelConfig:
    """Process-wide kernel settings; `validate` names the field, the bad value and the allowed ones."""

    backend: str = "auto"  # "auto" (triton with a CUDA GPU and triton installed, else torch) | "torch" | "triton"
    kda_backward: str = "triton"  # chunk_kda's backward on the triton backend: Triton kernels, or the PyTorch recompute
    kda_recompute: bool = False  # True: the KDA backward recomputes the forward's states (1.5 KB less a token and head)
    kda_fp32_dots: str = "tf32x3"  # KDA chunk-kernel dots for fp32 inputs: "tf32x3" (near fp32) | "ieee" | "tf32"

    def validate(self) -> KernelConfig:
        """self, or ValueError naming the first bad field."""
        for name, allowed in (("backend", BACKENDS), ("kda_backward", KDA_BACKWARDS),
                              ("kda_fp32_dots", FP32_DOT_PRECISIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"KernelConfig.{name} must be one of {allowed}, got {value!r}")
        if not isinstance(self.kda_recompute, bool):
            raise ValueError(  # noqa: TRY004 - validate reports every bad field as ValueError
                f"KernelConfig.kda_recompute must be True or False, got {self.kda_recompute!r}")
        return self


# field -> the environment variable that overrides it
ENV_VARS = {"backend": "K3_KERNELS", "kda_backward": "K3_KDA_BWD", "kda_recompute": "K3_KDA_RECOMPUTE",
            "kda_fp32_dots": "K3_KDA_FP32_DOTS"}


def _parse_env(name: str, raw: str):
    """The field value of environment variable ENV_VARS[name] = raw (stripped, non-empty); ValueError names it."""
    var, v = ENV_VARS[name], raw.strip().lower()
    if name == "backend":
        if v not in ("torch", "triton"):
            raise ValueError(f"{var}={raw!r} is not a kernel backend; use {var}=torch or {var}=triton (or unset it "
                             f"for auto)")
        return v
    if name == "kda_backward":
        if v not in KDA_BACKWARDS:
            raise ValueError(f"{var} must be 'triton' or 'torch', got {v!r}; unset it for the default backward")
        return v
    if name == "kda_recompute":
        if v in _FALSE:
            return False
        if v in _TRUE:
            return True
        raise ValueError(f"{var} must be 0 (keep the forward's states for the backward, the default) or 1 "
                         f"(recompute them in the backward, less memory), got {v!r}")
    if v not in FP32_DOT_PRECISIONS:
        raise ValueError(f"{var} must be one of {FP32_DOT_PRECISIONS}, got {v!r}; unset it for 'tf32x3'")
    return v


def with_env_overrides(cfg: KernelConfig) -> tuple[KernelConfig, dict[str, str]]:
    """(cfg with every set environment override applied, validated; {variable: its value} of those applied).
    A variable set to an empty string counts as unset."""
    cfg.validate()
    values, applied = {}, {}
    for name, var in ENV_VARS.items():
        raw = os.environ.get(var, "")
        if raw.strip():
            values[name] = _parse_env(name, raw)
            applied[var] = raw
    return replace(cfg, **values).validate(), applied
