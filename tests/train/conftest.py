"""Shared fixtures of the train tests: the debug-preset pretrain config on a small slice of the default corpus."""

import pytest

from k3.cli.config import resolve_config


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("k3cache"))


@pytest.fixture
def debug_cfg(cache_dir):
    """debug_cfg(*sets) -> the debug preset's pretrain config: 400 kB of the corpus, batch 4, a line every step, no
    evaluation or checkpoints until the end, one thread; `sets` (a.b=v strings) override."""
    base = [f"data.cache_dir={cache_dir}", "data.max_bytes=400000", "data.tokenizer_sample_bytes=200000",
            "train.batch_size=4", "train.log_every=1", "train.eval_every=0", "train.eval_batches=2",
            "ckpt.every=0", "train.threads=1"]
    return lambda *sets: resolve_config("pretrain", preset="debug", sets=base + list(sets))
