"""Losses: the LM head + cross-entropy fused over chunks of tokens (chunked.py), so the [N, V] logits never exist.

`linear_cross_entropy` is GEMMs in PyTorch around one [C, V] step per chunk (the log-sum-exp, the target's
log-probability and the softmax gradient in place): a Triton kernel on the "triton" backend (triton.py), the PyTorch
twin `chunked.softmax_rows_torch` otherwise; the whole-logits twin of the loss is naive.py. Legend: N tokens, D width, V vocab.
"""

from __future__ import annotations

import torch

from .chunked import chunked_linear_cross_entropy
from .naive import linear_cross_entropy as linear_cross_entropy_torch

# bytes of one chunk's fp32 [C, V] block: on a CPU a few MiB, in cache (2 cores of a Xeon, 2026-12-02, N = 4096,
# D = 128, V = 4096: 256 to 1024 tokens the fastest, 64 ~25% and 4096 ~45% slower; benchmarks/linear_ce.py --chunks);
# on a GPU big enough to keep the GEMMs at rate and small against the whole logits (k3-small: C = 2048 of N = 16,384
# tokens, 256 MiB in place of 2 GiB)
CHUNK_BYTES = {"cpu": 4 << 20, "other": 256 << 20}
# each chunk also reads and writes dW [V, D] once (dW += G^T h): below ~64 tokens that traffic dominates (the same
# CPU at D = 768, V = 32,768: 16 tokens 3x, 32 tokens 1.4x the time of 64 to 256)
MIN_CHUNK = 64


def default_chunk_tokens(vocab_size: int, device: torch.device | str) -> int:
    """Tokens per chunk when none is given: the largest power of two whose fp32 [C, V] block fits CHUNK_BYTES for
    the device type, at least MIN_CHUNK. Example: default_chunk_tokens(4096, "cpu") == 256."""
    kind = "cpu" if torch.device(device).type == "cpu" else "other"
    c = max(CHUNK_BYTES[kind] // (4 * max(vocab_size, 1)), MIN_CHUNK)
    return 1 << (c.bit_length() - 1)


def compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The GEMMs' dtype, as F.linear would run them: the autocast dtype where autocast is on for the device (float64
    is never cast), else the inputs' common dtype."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev) and torch.float64 not in (h.dtype, weight.dtype):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, weight.dtype)


def linear_cross_entropy(h_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,
                         chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of the logits h W^T [N, V] against targets [N] (-100 not counted), computed over chunks of
    `chunk_tokens` tokens (None: `default_chunk_tokens`) without forming the whole logits; the gradients of h and W
    are formed in the forward (chunked.py). Equals naive.linear_cross_entropy, i.e. F.cross_entropy(F.linear(h,
    W).float(), targets), up to float summation order: a scalar in fp32 (float64 for float64 inputs), NaN when no
    target is counted, with zero gradients then. Under autocast the GEMMs run in the autocast dtype, the softmax in
    fp32; gradients come back in h's and W's dtypes.

    Example: loss = linear_cross_entropy(model.normed_hidden(hidden).flatten(0, 1), model.lm_head.weight,
    targets_BT.flatten())
    """
    if h_ND.dim() != 2 or weight_VD.dim() != 2 or h_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"linear_cross_entropy takes h [N, D] and weight [V, D], got {tuple(h_ND.shape)} and "
                         f"{tuple(weight_VD.shape)}; flatten the token dimensions of h first")
    if targets_N.shape != h_ND.shape[:1] or targets_N.is_floating_point() or targets_N.is_complex():
        raise ValueError(f"targets must be integer class indices [N] = [{h_ND.shape[0]}], got "
                         f"{targets_N.dtype} {tuple(targets_N.shape)}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive token count or None (the default), got {chunk_tokens}")
    chunk = chunk_tokens or default_chunk_tokens(weight_VD.shape[0], h_ND.device)
    return chunked_linear_cross_entropy(h_ND, weight_VD, targets_N.long(), chunk, compute_dtype(h_ND, weight_VD))


__all__ = ["CHUNK_BYTES", "MIN_CHUNK", "compute_dtype", "default_chunk_tokens", "linear_cross_entropy",
           "linear_cross_entropy_torch"]
