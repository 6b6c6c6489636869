"""The kernel comparison metric of kda.md section 6.1, for the tests of every kernel against its reference.

Pass if max |ref - out| <= 1e-6; otherwise neither side may hold a NaN and the relative RMS error
rms(ref - out) / (rms(ref) + 1e-8) must stay below `ratio`. Both tensors are compared in float64 on the CPU.
"""

from __future__ import annotations

import torch

# the device the kernel tests run on, and their low-precision dtype: bf16 on a GPU, fp16 under the CPU interpreter
# (which has no bf16)
TEST_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOW_PRECISION = torch.bfloat16 if torch.cuda.is_available() else torch.float16


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float = 1e-5) -> None:
    """Assert the kda.md 6.1 closeness of `out` to `ref` (same shape); the message names `name` and the error.

    Example: assert_close("o", o_ref_float64, o_triton_bf16, 0.005)
    """
    ref, out = ref.detach().double().cpu(), out.detach().double().cpu()
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    abs_err = (ref - out).abs().max().item() if ref.numel() else 0.0
    if abs_err <= 1e-6:
        return
    assert not torch.isnan(ref).any() and not torch.isnan(out).any(), f"{name}: NaN"
    rel = ((ref - out).pow(2).mean().sqrt() / (ref.pow(2).mean().sqrt() + 1e-8)).item()
    assert rel < ratio, f"{name}: rel_rms {rel:.3e} >= {ratio} (abs_err {abs_err:.3e})"
