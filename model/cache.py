"""Inference state of a K3 model: per KDA layer a recurrent state + conv tails, per MLA layer the latent cache.

This is the static, contiguous form used by `k3 generate` and the tests: every sequence in a batch has consumed
the same number of tokens. The serving engine (k3.serve) keeps its own paged/slotted pools with the same contents.

Legend: B batch, T tokens, H heads, K key dim, V value dim, W conv kernel, C channels, R cache width.

Layers mutate their cache object in place during prefill/decode; `K3Model.forward(..., state=...)` advances
`state.seq_len` once per call after all layers ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KDACache:
    """One KDA layer. `None` tensors mean "no tokens consumed yet" (zero state, zero conv history)."""

    state: torch.Tensor | None = None  # [B, H, K, V] fp32 recurrent state S
    conv_q: torch.Tensor | None = None  # [B, W-1, H*K] last W-1 pre-conv inputs of the q path
    conv_k: torch.Tensor | None = None  # [B, W-1, H*K]
    conv_v: torch.Tensor | None = None  # [B, W-1, H*V]

    def clone(self) -> KDACache:
        c = lambda t: None if t is None else t.clone()
        return KDACache(c(self.state), c(self.conv_q), c(self.conv_k), c(self.conv_v))


@dataclass
class MLACache:
    """One MLA layer: the compressed latent cache, [c_kv (normalized) ; k_rope] per token."""

    kv: torch.Tensor | None = None  # [B, T_cached, kv_lora + qk_rope]; k_rope already rotated in rope mode

    @property
    def length(self) -> int:
        return 0 if self.kv is None else self.kv.shape[1]

    def clone(self) -> MLACache:
        return MLACache(None if self.kv is None else self.kv.clone())


@dataclass
class InferenceState:
    """Whole-model state: `layers[i]` is a KDACache or an MLACache by layer type; `mtp` caches the MTP block."""

    layers: list = field(default_factory=list)
    mtp: MLACache | None = None
    seq_len: int = 0  # tokens consumed so far (positions of the next tokens start here)

    def clone(self) -> InferenceState:
        return InferenceState([c.clone() for c in self.layers], None if self.mtp is None else self.mtp.clone(),
                              self.seq_len)
