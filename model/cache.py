"""Inference state of a K3 model and the cache views through which its mixers reach it.

Every token mixer (KDA, MLA, the MTP's MLA) reads and writes its state only through a view argument, so one
forward serves training (no view), `k3 generate` and the tests (the contiguous views here) and the serving engine
(k3.serve.cache builds the same views over its paged pools, and its CUDA graphs capture this forward). A view holds
tensors, indices and the bookkeeping of where results go; the layers do all the math and call the kernels.

KDA layer, `KDAStateView` (one per layer and forward call):
    state       [P, H, K, V] fp32   the recurrent states, read and (unless `slots` is None) written in place
    slots       None                rows 0..N-1 are the sequences (contiguous: `state` is replaced by the kernel's
                                    final state, [N, H, K, V], or None before the first call)
                [N] int64           sequence n starts from state[slots[n]] and leaves its final state there
                [N, T] int64        per token (speculative verify): start from state[slots[:, 0]], the state after
                                    token t goes to state[slots[:, t]]; -1 = start from zeros / write nothing
    cu_seqlens  [N+1] int64         packed varlen input (x is [1, T]); None: the rows of x are the sequences
    max_len     host int | None     the longest sequence's new tokens (None: x.shape[1]); up to
                                    RECURRENT_MAX_TOKENS the recurrent kernel runs (if `allow_recurrent`), beyond
                                    it the chunk kernel
    chunk_states                    ask the chunk kernel for its per-chunk states in fp32 (handed to `state_done`)
    trusted                         indices were checked on the host: the kernels skip their device-reading checks
    conv_tails() -> 3 x [N, W-1, C] the q/k/v short-conv histories (None = zeros)
    conv_done(tails0, tails1, pre)  where the new tails go; pre = the pre-conv inputs [B, T, C] of q, k, v
    state_done(final, chunk_states) after the recurrence (final None on the in-place recurrent path)

MLA layer: `MLACache` (contiguous: the latents of B equal-length sequences, grown by concatenation) or a
`PagedLatentView` (latents written into pages through a slot mapping, attention through block tables).

Legend: B batch, T tokens, N sequences, P pool rows, H heads, K key dim, V value dim, W conv kernel, C channels,
X latent width (kv_lora + qk_rope), G pages per block table, S page size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class KDAStateView:
    """The protocol of module docstring; subclasses choose storage (KDACache here, the engine's pools in
    k3.serve.cache). Defaults: rows of x are sequences, no chunk states, nothing trusted."""

    state: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: list[int] | None = None
    max_len: int | None = None
    allow_recurrent: bool = True
    chunk_states: bool = False
    trusted: bool = False

    def conv_tails(self) -> tuple:
        raise NotImplementedError

    def conv_done(self, tails0: tuple, tails1: tuple, pre: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def state_done(self, final: torch.Tensor | None, chunk_states: torch.Tensor | None) -> None:
        """Nothing to do after the recurrence by default (the engine writes prefix-cache snapshots here)."""


@dataclass(eq=False)
class KDACache(KDAStateView):
    """One KDA layer of B contiguous sequences. `None` tensors mean "no tokens consumed yet" (zero state, zero
    conv history); the layer replaces them with the new ones after each call."""

    state: torch.Tensor | None = None  # [B, H, K, V] fp32 recurrent state S
    conv_q: torch.Tensor | None = None  # [B, W-1, H*K] last W-1 pre-conv inputs of the q path
    conv_k: torch.Tensor | None = None  # [B, W-1, H*K]
    conv_v: torch.Tensor | None = None  # [B, W-1, H*V]

    def conv_tails(self) -> tuple:
        return self.conv_q, self.conv_k, self.conv_v

    def conv_done(self, tails0: tuple, tails1: tuple, pre: list[torch.Tensor]) -> None:
        self.conv_q, self.conv_k, self.conv_v = tails1

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


@dataclass(eq=False)
class LatentGroup:
    """Sequences of one paged attention call: `n` sequences of `t` new tokens each."""

    rows: torch.Tensor | None  # [n * t] rows of the call's flattened tokens; None = all of them, in order
    n: int
    t: int
    block_table: torch.Tensor  # [n, G] page ids (positions past a sequence's are masked)
    positions: torch.Tensor  # [n, t] absolute position of each query (it sees keys <= its position)


@dataclass(eq=False)
class PagedLatentView:
    """One MLA layer over a paged latent pool: the new tokens' latents are written first (every query sees itself),
    then each group attends through its block table. Keys below `min_key` are masked (the MTP's empty slot 0)."""

    kv_pool: torch.Tensor  # [P, S, X] pages of this layer
    slot_mapping: torch.Tensor  # [N_tok] flat pool row of each new token (page * S + offset)
    positions: torch.Tensor  # [N_tok] absolute positions of the new tokens, flattened like x's rows
    groups: list[LatentGroup] = field(default_factory=list)
    min_key: int = 0

    def write(self, latent_NX: torch.Tensor) -> None:
        """Store the new latents [N_tok, X] at their slots."""
        flat = self.kv_pool.view(-1, self.kv_pool.shape[-1])
        flat[self.slot_mapping] = latent_NX.to(flat.dtype)


@dataclass
class InferenceState:
    """Whole-model state: `layers[i]` is layer i's view (a KDACache or an MLACache here, by layer type); `mtp` is
    the MTP block's latent view."""

    layers: list = field(default_factory=list)
    mtp: MLACache | PagedLatentView | None = None
    seq_len: int = 0  # tokens consumed so far (positions of the next tokens start here)

    def clone(self) -> InferenceState:
        return InferenceState([c.clone() for c in self.layers], None if self.mtp is None else self.mtp.clone(),
                              self.seq_len)
