"""Each data-parallel rank's share of the batches: disjoint rows of one global batch.

The global batch of a step is what a single process would read with train.batch_size x world size sequences: the
same windows in the same order. Rank r takes its contiguous rows [r B, (r + 1) B), so a DP=N run with
train.batch_size B trains on exactly the batches of a one-process run with batch size N B, and the loader's state
(epoch, position in the window order) is the same on every rank and for every world size.
"""

from __future__ import annotations

import numpy as np
import torch

from ..data import BatchLoader, DataError, TokenShard


class RankBatchLoader(BatchLoader):
    """A BatchLoader over global batches of `world x batch_size` windows that returns rank `rank`'s rows.

    Train mode: [batch_size, T+1] per rank, rows r B .. r B + B - 1 of the global batch. Val mode: each global batch
    of up to world x batch_size windows split as evenly as possible (rank r its r-th part); under FSDP every forward
    is collective, so the windows are cut to a multiple of the world size (at most world - 1 left out).
    Example: RankBatchLoader(data.train, batch_size=8, seq_len=256, rank=1, world=2).next_batch()[0].shape == (8, 257)
    """

    def __init__(self, shard: TokenShard, *, batch_size: int, seq_len: int, seed: int = 0, mode: str = "train",
                 rank: int, world: int):
        if not 0 <= rank < world:
            raise ValueError(f"need 0 <= rank < world, got rank {rank} and world {world}")
        super().__init__(shard, batch_size=batch_size * world, seq_len=seq_len, seed=seed, mode=mode)
        self.rank, self.world = rank, world
        if mode == "val":
            self.n_windows -= self.n_windows % world
            if self.n_windows == 0:
                raise DataError(f"the {shard.name} split holds fewer windows of {seq_len + 1} tokens than the "
                                 f"{world} ranks; lower data.seq_len or raise data.val_fraction")

    def _gather(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return super()._gather(np.array_split(windows, self.world)[self.rank])
