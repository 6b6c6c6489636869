"""`k3 pretrain --init CKPT --preset sft` on chat JSONL: the ChatML turns with the special tokens parsed, the loss on
the assistant turn only, the checkpoint's architecture and sequence length kept."""

import itertools
import json
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from k3.cli.config import resolve_config
from k3.cli.main import app
from k3.model.checkpoint import read_release_config
from k3.model.tokenizer import IM_END, IM_START, K3Tokenizer
from k3.train.data import DataError, prepare_data
from k3.train.pretrain import run as pretrain_run


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    sets = ["train.max_steps=2", "train.batch_size=4", "data.max_bytes=300000", "data.tokenizer_sample_bytes=200000",
            f"data.cache_dir={root / 'cache'}", "train.eval_every=0", "train.eval_batches=1", "ckpt.every=0",
            "train.threads=1"]
    pretrain_run(resolve_config("pretrain", preset="debug", sets=sets), run_dir=root / "base")
    chats = root / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"add {i} and {i + 1}"},
                                                      {"role": "assistant", "content": f"{2 * i + 1}"}]}) + "\n"
                             for i in range(300)))
    return root


def test_messages_are_chatml_with_special_tokens_and_only_the_assistant_turn_counts(base, tmp_path):
    tok = K3Tokenizer.from_file(base / "base" / "final")
    cfg = resolve_config("pretrain", preset="debug", sets=[f"data.source={base / 'chat.jsonl'}",
                                                            f"data.tokenizer={base / 'base' / 'final' / 'tokenizer.json'}",
                                                            f"data.cache_dir={tmp_path / 'c'}"]).data
    data = prepare_data(cfg, 512, show_progress=False)
    ids, mask = np.asarray(data.train.tokens), np.asarray(data.train.loss_mask)
    start, end = tok.encode(IM_START)[0], tok.encode(IM_END)[0]
    n_docs = int((ids == tok.eos_id).sum()) - 1  # the shard ends with a separator too
    assert tok.is_special(start) and (ids == start).sum() == (ids == end).sum() == 2 * n_docs > 0  # parsed, 2 turns
    doc = np.nonzero(ids == tok.eos_id)[0]
    for a, b in itertools.pairwise(doc[:4]):  # each document: ChatML after the separator (BOS), the answer counted
        text = tok.decode(ids[a + 1:b].tolist())
        m = re.fullmatch(rf"{re.escape(IM_START)}user\nadd (\d+) and \d+{re.escape(IM_END)}\n"
                         rf"{re.escape(IM_START)}assistant\n(\d+){re.escape(IM_END)}", text)
        assert m and int(m[2]) == 2 * int(m[1]) + 1, text
        assert tok.decode(ids[a + 1:b][mask[a + 1:b] == 1].tolist()) == f"{m[2]}{IM_END}"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match="must end with a non-empty assistant turn"):
        prepare_data(resolve_config("pretrain", preset="debug", sets=[f"data.source={bad}",
                                                                       f"data.cache_dir={tmp_path / 'c'}"]).data,
                     512, show_progress=False)


def test_sft_preset_keeps_the_checkpoint_and_needs_init(base, tmp_path):
    out = tmp_path / "teacher"
    r = CliRunner().invoke(app, ["pretrain", "--init", str(base / "base" / "final"), "--preset", "sft", "--set",
                                 f"data.source={base / 'chat.jsonl'}", "--set", "train.max_steps=6", "--set",
                                 "train.batch_size=4", "--set", "train.eval_every=0", "--set", "train.eval_batches=1",
                                 "--set", f"data.cache_dir={tmp_path / 'c'}", "--set", "train.threads=1", "--out",
                                 str(out)])
    assert r.exit_code == 0, r.output
    assert read_release_config(out / "final") == read_release_config(base / "base" / "final")
    assert json.loads((out / "final" / "config.json").read_text())["max_position_embeddings"] == 64
    r = CliRunner().invoke(app, ["pretrain", "--preset", "sft", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "--init" in r.output and not (tmp_path / "x").exists()
