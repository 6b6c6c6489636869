"""Memory pools of the serving engine: paged latents, KDA working slots, prefix snapshots (kda.md section 8).

1. `PagePool`: the MLA latent cache in fixed-size pages, [pages, page_size, C + R] per MLA layer (the MTP layer
   included); a sequence owns a block table (list of page ids). Full pages are registered under the hash of the
   token prefix they end (`block_hashes`), ref-counted, and reused by later sequences with the same prefix; a page
   with no reference stays cached (LRU) until a new allocation needs it.
2. `StatePool`: one working slot per running sequence for every KDA layer: state [H, K, V] fp32 and the three conv
   tails [W-1, C] (last W-1 pre-conv inputs of q, k, v). With speculative decoding every working slot also owns
   `spec_tokens` scratch states: a verify step writes the state after each draft token there, so a rejected draft
   rolls back by copying the last accepted one (`token_slot`).
3. `SnapshotStore`: fp32 KDA state + conv-tail snapshots at block boundaries, keyed by block hash, LRU. Entries are
   preallocated as NaN; an entry becomes readable only after it has been fully written and marked valid, and
   reading an invalid entry raises (kda.md 8 rule 3), so a never-written snapshot can never leak into outputs.
   With speculative decoding an entry also keeps the main model's final hidden of the token before the boundary
   (`hidden`, [S, D]): the MTP drafter pairs it with the next token after a prefix hit.

Legend: P pages or slots, S snapshot entries, L layers, H heads, K key dim, V value dim, W conv kernel, C channels,
X latent width (kv_lora + qk_rope).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import torch


class OutOfPages(RuntimeError):
    """The latent page pool has no free or evictable page left."""


def block_hashes(tokens: list[int], block_size: int, count: int | None = None) -> list[bytes]:
    """Chained hashes of the first `count` full blocks of `tokens` (default: all full blocks).

    h_i = sha256(h_{i-1} || int64 bytes of block i), h_{-1} = b"", so equal hashes mean equal whole prefixes.
    Example: block_hashes(list(range(130)), 64) -> two 32-byte digests
    """
    n = len(tokens) // block_size if count is None else count
    out, prev = [], b""
    for i in range(n):
        prev = chain_hash(prev, tokens[i * block_size:(i + 1) * block_size])
        out.append(prev)
    return out


def chain_hash(prev: bytes, block: list[int]) -> bytes:
    """sha256(prev || int64 bytes of block): the hash of a block given its parent's hash (b"" for the first)."""
    return hashlib.sha256(prev + np.asarray(block, dtype=np.int64).tobytes()).digest()


class PagePool:
    """Paged latent cache for `num_layers` MLA layers. kv[l]: [P, page_size, X]."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, width: int, dtype: torch.dtype,
                 device: torch.device | str):
        if num_pages < 1:
            raise ValueError(f"the latent page pool needs at least one page, got {num_pages}")
        self.page_size, self.num_pages = page_size, num_pages
        self.kv = [torch.zeros(num_pages, page_size, width, dtype=dtype, device=device) for _ in range(num_layers)]
        self.ref = [0] * num_pages
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # never-hashed free pages (stack)
        self.cached: OrderedDict[int, None] = OrderedDict()  # ref 0 but hashed: reusable, evicted LRU-first
        self.hash_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Pages an allocation can take now (free plus evictable cached)."""
        return len(self.free) + len(self.cached)

    def usage(self) -> float:
        """Fraction of pages referenced by running sequences, 0-1 (k3:kv_cache_usage_perc)."""
        return 1.0 - self.num_free / self.num_pages

    def allocate(self) -> int:
        """One page for a sequence (ref 1); evicts the least recently used cached page when no free page is left."""
        if self.free:
            p = self.free.pop()
        elif self.cached:
            p, _ = self.cached.popitem(last=False)
            del self.page_of[self.hash_of.pop(p)]
        else:
            raise OutOfPages("latent page pool exhausted")
        self.ref[p] = 1
        return p

    def lookup(self, h: bytes) -> int | None:
        """Page holding the full block with prefix hash `h`, or None."""
        return self.page_of.get(h)

    def acquire(self, p: int) -> None:
        """Take a reference on a cached page (prefix hit)."""
        if self.ref[p] == 0:
            self.cached.pop(p, None)
        self.ref[p] += 1

    def register(self, p: int, h: bytes) -> None:
        """Publish a page that was just completely written as the block with prefix hash `h`."""
        if h in self.page_of or p in self.hash_of:
            return  # another sequence published the same prefix first; this copy stays private
        self.page_of[h], self.hash_of[p] = p, h

    def release(self, pages: list[int]) -> None:
        """Drop one reference on each page; unreferenced hashed pages stay cached, the others become free."""
        for p in pages:
            self.ref[p] -= 1
            if self.ref[p] == 0:
                if p in self.hash_of:
                    self.cached[p] = None
                else:
                    self.free.append(p)

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached page (they become free)."""
        for p in list(self.cached):
            del self.page_of[self.hash_of.pop(p)]
            self.free.append(p)
        self.cached.clear()


class StatePool:
    """KDA working slots: state[l] [P * (1 + spec_tokens), H, K, V] fp32 (working slots first, then each slot's
    scratch states) and tails[l] = (q, k, v) each [P, W-1, C] per KDA layer."""

    def __init__(self, num_layers: int, num_slots: int, heads: int, head_dim: int, conv_width: int,
                 tail_dtype: torch.dtype, device: torch.device | str, spec_tokens: int = 0):
        C = heads * head_dim
        self.num_slots, self.spec_tokens = num_slots, spec_tokens
        rows = num_slots * (1 + spec_tokens)
        self.state = [torch.zeros(rows, heads, head_dim, head_dim, dtype=torch.float32, device=device)
                      for _ in range(num_layers)]
        self.tails = [tuple(torch.zeros(num_slots, conv_width - 1, C, dtype=tail_dtype, device=device)
                            for _ in range(3)) for _ in range(num_layers)]
        self.free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int:
        """A zeroed slot (empty history)."""
        if not self.free:
            raise RuntimeError("KDA state pool exhausted; the scheduler admits at most max_num_seqs sequences")
        s = self.free.pop()
        for st, tails in zip(self.state, self.tails):
            st[s].zero_()
            for t in tails:
                t[s].zero_()
        return s

    def release(self, s: int) -> None:
        self.free.append(s)

    def token_slot(self, s: int, t: int) -> int:
        """Row of state[l] holding slot s's state after token t of a verify step: the working slot itself for t = 0
        (the first token of a verify step is always kept), scratch row t for a draft token t in 1..spec_tokens."""
        if t == 0:
            return s
        if not 1 <= t <= self.spec_tokens:
            raise ValueError(f"token index {t} outside the verify step (1 + {self.spec_tokens} tokens)")
        return self.num_slots + s * self.spec_tokens + t - 1


class SnapshotStore:
    """fp32 KDA snapshots at block boundaries: state[l] [S, H, K, V], tails[l] 3 x [S, W-1, C] (fp32), NaN until
    written. Protocol: `reserve(h)` -> entry index (not yet readable), write it, `publish(h, idx)`; `find(h)` ->
    valid index or None; `read_into(idx, pool, slot)` copies it into a working slot."""

    def __init__(self, num_layers: int, num_entries: int, heads: int, head_dim: int, conv_width: int,
                 device: torch.device | str, hidden_dim: int = 0):
        C = heads * head_dim
        self.num_entries = num_entries
        nan = float("nan")
        self.hidden = torch.full((num_entries, hidden_dim), nan, device=device) if hidden_dim else None
        self.state = [torch.full((num_entries, heads, head_dim, head_dim), nan, device=device)
                      for _ in range(num_layers)]
        self.tails = [tuple(torch.full((num_entries, conv_width - 1, C), nan, device=device) for _ in range(3))
                      for _ in range(num_layers)]
        self.valid = [False] * num_entries
        self.entry_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # valid entries, least recently used first
        self.free = list(range(num_entries - 1, -1, -1))
        self.evictions = 0

    def find(self, h: bytes) -> int | None:
        """Index of a valid snapshot for prefix hash `h` (marks it recently used), or None."""
        i = self.entry_of.get(h)
        if i is None or not self.valid[i]:
            return None
        self.lru.move_to_end(i)
        return i

    def reserve(self, h: bytes) -> int | None:
        """An entry to write the snapshot of `h` into (evicting the LRU valid one if needed); None when `h` is
        already stored or nothing can be evicted. The entry stays invalid until `publish`."""
        if h in self.entry_of or self.num_entries == 0:
            return None
        if self.free:
            i = self.free.pop()
        elif self.lru:
            i, _ = self.lru.popitem(last=False)
            del self.entry_of[self.hash_of.pop(i)]
            self.valid[i] = False
            self.evictions += 1
        else:
            return None
        return i

    def publish(self, h: bytes, i: int) -> None:
        """Mark entry i (fully written) valid under hash h."""
        self.entry_of[h], self.hash_of[i] = i, h
        self.valid[i] = True
        self.lru[i] = None

    def write(self, i: int, layer: int, state_HKV: torch.Tensor, tails: tuple[torch.Tensor, ...]) -> None:
        """Copy one layer's state [H, K, V] and tails 3 x [W-1, C] into (reserved) entry i, as fp32."""
        self.state[layer][i].copy_(state_HKV.float())
        for dst, src in zip(self.tails[layer], tails):
            dst[i].copy_(src.float())

    def write_hidden(self, i: int, hidden_D: torch.Tensor) -> None:
        """Copy the main final hidden [D] of the token before entry i's boundary (speculative decoding only)."""
        self.hidden[i].copy_(hidden_D.float())

    def read_hidden(self, i: int) -> torch.Tensor:
        """The hidden [D] stored with valid entry i (fp32 copy)."""
        if not self.valid[i]:
            raise RuntimeError(f"snapshot entry {i} was never written (or was evicted); refusing to read it")
        return self.hidden[i].clone()

    def read_into(self, i: int, pool: StatePool, slot: int) -> None:
        """Restore valid entry i into working slot `slot` of `pool` (all layers). Reading an unwritten entry is an
        error (kda.md 8 rule 3)."""
        if not self.valid[i]:
            raise RuntimeError(f"snapshot entry {i} was never written (or was evicted); refusing to read it")
        for layer in range(len(self.state)):
            pool.state[layer][slot].copy_(self.state[layer][i])
            for dst, src in zip(pool.tails[layer], self.tails[layer]):
                dst[slot].copy_(src[i].to(dst.dtype))

    def clear(self) -> None:
        """Invalidate every entry (reset_prefix_cache)."""
        for i in list(self.lru):
            self.valid[i] = False
            self.free.append(i)
        self.lru.clear()
        self.entry_of.clear()
        self.hash_of.clear()
