"""k3.train.data: sources, split, cache, masking, BatchLoader order and exact resume, errors."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from k3.model.config import ConfigError
from k3.model.tokenizer import EOT, K3Tokenizer, train_bpe
from k3.train.config import DataConfig
from k3.train.data import (
    BatchLoader,
    DataError,
    TokenShard,
    _FileSource,
    _make_plan,
    _split_records,
    _StdlibSource,
    _tokenizer_sample,
    prepare_data,
)

V = 300  # small vocab: trains in well under a second


def cfg(tmp_path, **kw):
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    kw.setdefault("vocab_size", V)
    return DataConfig(**kw)


def prep(c, vocab=512, **kw):
    return prepare_data(c, vocab, show_progress=False, **kw)


def docs_of(tok, shard):
    """Split a shard back into document texts at <|endoftext|> (an independent decode of what was written)."""
    ids = np.asarray(shard.tokens).tolist()
    assert ids[0] == tok.eos_id and ids[-1] == tok.eos_id
    out, cur = [], []
    for i in ids[1:]:
        if i == tok.eos_id:
            out.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    return out


# ---- stdlib


@pytest.fixture(scope="module")
def stdlib_plan():
    src = _StdlibSource()
    return src, _make_plan(src, 0.05, None, "stdlib")


def test_stdlib_split_is_by_file_deterministic_and_disjoint(stdlib_plan):
    src, plan = stdlib_plan
    assert not any(part in ("site-packages", "dist-packages") for f in src.files for part in f.parts)
    assert any(k[0].startswith("test/") for k in src.manifest["files"])  # the test suite is real Python: kept
    train = [r.key for r in _split_records(src, plan, "train")]
    val = [r.key for r in _split_records(src, plan, "val")]
    assert not set(train) & set(val) and len(train) == len(set(train))
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.09
    src2 = _StdlibSource()
    plan2 = _make_plan(src2, 0.05, None, "stdlib")
    assert [r.key for r in _split_records(src2, plan2, "val")] == val
    # a file's side depends only on its own path: a different fraction moves files one way only
    plan3 = _make_plan(src2, 0.10, None, "stdlib")
    val3 = {r.key for r in _split_records(src2, plan3, "val")}
    assert set(val) < val3
    assert src.manifest["files"] == sorted(src.manifest["files"])


def test_stdlib_prepare_reconstructs_text(tmp_path):
    c = cfg(tmp_path, max_bytes=200_000, val_fraction=0.1)
    data = prep(c)
    tok = data.tokenizer
    assert data.train.tokens.dtype == np.uint16 and data.train.loss_mask is None
    src = _StdlibSource()
    plan = _make_plan(src, 0.1, 200_000, "stdlib")
    for shard in (data.train, data.val):
        texts = [r.text for r in _split_records(src, plan, shard.name)]
        assert docs_of(tok, shard) == texts
        st = data.meta["splits"][shard.name]
        assert st["n_bytes"] == sum(len(t.encode()) for t in texts) and st["n_tokens"] == shard.n_tokens
    assert 199_997 <= data.meta["n_bytes"] <= 200_000  # the record crossing the cap is truncated to fill it
    bpt = data.meta["val_bytes_per_token"]
    assert bpt == pytest.approx(data.meta["splits"]["val"]["n_bytes"] / (data.val.n_tokens - 1))
    assert set(data.meta["skipped"]) <= {"test/tokenizedata/bad_coding.py", "test/tokenizedata/bad_coding2.py",
                                         "test/tokenizedata/badsyntax_pep3120.py"}


# ---- cache


def write_txt(d, n=6, extra=""):
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (d / f"doc{i}.txt").write_text(f"# doc {i} ünï 🙂\n" + f"def f{i}(x):\n    return x * {i}\n" * 20 + extra)
    return d


def test_cache_hit_reuses_shards_and_changes_with_data(tmp_path):
    src = write_txt(tmp_path / "txt")
    c = cfg(tmp_path, source=str(src / "*.txt"), val_fraction=0.2)
    a = prep(c, tokenizer_out_dir=tmp_path / "tok_out")
    stamp = {p.name: p.stat().st_mtime_ns for p in a.cache_dir.iterdir()}
    b = prep(c)
    assert b.cache_dir == a.cache_dir and b.meta == a.meta
    assert np.array_equal(b.train.tokens, a.train.tokens) and np.array_equal(b.val.tokens, a.val.tokens)
    assert {p.name: p.stat().st_mtime_ns for p in b.cache_dir.iterdir()} == stamp  # nothing rewritten
    assert K3Tokenizer.from_file(tmp_path / "tok_out").hash() == a.tokenizer.hash()
    assert not [p for p in a.cache_dir.parent.iterdir() if ".tmp-" in p.name]
    # a fresh cache trains the same tokenizer and writes the same shards
    fresh = prep(cfg(tmp_path, source=c.source, val_fraction=0.2, cache_dir=str(tmp_path / "other")))
    assert fresh.cache_dir.name == a.cache_dir.name
    (src / "doc3.txt").write_text("def changed():\n    pass\n")
    changed = prep(c)
    assert changed.cache_dir != a.cache_dir
    assert prep(cfg(tmp_path, source=c.source, val_fraction=0.4)).cache_dir not in (a.cache_dir, changed.cache_dir)


def test_reused_tokenizer_and_uint32_shards(tmp_path):
    src = write_txt(tmp_path / "txt", n=3)
    tok = train_bpe(["def f(x):\n    return x\n"] * 5, vocab_size=V)
    big = [f"\x01{i:05d}\x02" for i in range(66_000)]  # push the vocab past uint16
    tok.backend.add_tokens(big)
    tok.save(tmp_path / "tok")
    (src / "doc0.txt").write_text(f"x = 1 {big[-1]} y\n")
    data = prep(cfg(tmp_path, source=str(src), tokenizer=str(tmp_path / "tok")), vocab=70_000)
    assert data.tokenizer.hash() == tok.hash() and data.meta["dtype"] == "uint32"
    ids = np.concatenate([data.train.tokens, data.val.tokens])
    assert ids.dtype == np.uint32 and tok.backend.token_to_id(big[-1]) in ids.tolist()
    with pytest.raises(ConfigError, match="model.vocab_size"):
        prep(cfg(tmp_path, source=str(src), tokenizer=str(tmp_path / "tok")), vocab=512)


# ---- jsonl / txt / parquet


def test_jsonl_prompt_completion_masks_only_completion(tmp_path):
    rows = [{"prompt": f"Q{i}: what is {i}+{i}?\nA:", "completion": f" {2 * i} ünï"} for i in range(12)]
    rows += [{"text": f"plain document {i} 🙂"} for i in range(4)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # blank lines are skipped
    data = prep(cfg(tmp_path, source=str(path), val_fraction=0.25))
    tok = data.tokenizer
    counted, ignored = [], []
    for shard in (data.train, data.val):
        assert shard.loss_mask is not None and data.meta["splits"][shard.name]["has_mask"]
        ids, mask = shard.tokens.tolist(), shard.loss_mask.tolist()
        assert all(m == 1 for t, m in zip(ids, mask) if t == tok.eos_id)  # ending a document counts
        counted += tok.decode([t for t, m in zip(ids[1:], mask[1:]) if m]).split(EOT)
        ignored.append(tok.decode([t for t, m in zip(ids, mask) if not m]))
    expect = [r.get("completion", r.get("text")) for r in rows]
    assert sorted(s for s in counted if s) == sorted(expect)
    assert "".join(ignored) != "" and sorted("".join(ignored).split("A:")[:-1]) == sorted(
        r["prompt"][:-2] for r in rows if "prompt" in r)
    st = data.meta["splits"]["val"]
    assert data.meta["val_bytes_per_token"] == pytest.approx(st["n_loss_bytes"] / st["n_loss_tokens"])
    assert st["n_loss_tokens"] == int(data.val.loss_mask[1:].sum())
    # the loader's mask is the shard's mask shifted onto the targets
    T = 8
    ld = BatchLoader(data.train, batch_size=4, seq_len=T, seed=0)
    for x, m in ld.take(-(-ld.n_windows // 4)):  # one epoch: every window
        assert x.shape == (4, T + 1) and m.shape == (4, T) and m.dtype == torch.bool
        for b, s in enumerate(_starts(data.train, x, T)):
            assert m[b].tolist() == [bool(v) for v in data.train.loss_mask[s + 1:s + T + 1]]


def _starts(shard, x, T):
    """Window starts of a batch: the window index w has tokens[w*T : w*T+T+1]."""
    out = []
    for row in x.tolist():
        ws = [w for w in range((shard.n_tokens - 1) // T) if shard.tokens[w * T:w * T + T + 1].tolist() == row]
        out.append(ws[0] * T)
    return out


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"row {i}: def g{i}():\n    return '{i}' 🙂\n" for i in range(10)]
    pq.write_table(pa.table({"text": texts, "id": list(range(10))}), tmp_path / "d.parquet")
    data = prep(cfg(tmp_path, source=str(tmp_path / "d.parquet"), val_fraction=0.2))
    got = docs_of(data.tokenizer, data.train) + docs_of(data.tokenizer, data.val)
    assert sorted(got) == sorted(texts) and data.train.loss_mask is None
    pq.write_table(pa.table({"body": texts}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="bad.parquet: needs a 'text' column"):
        prep(cfg(tmp_path, source=str(tmp_path / "bad.parquet")))


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"pip install 'k3\[data\]'"):
        prep(cfg(tmp_path, source=str(tmp_path / "d.parquet")))


def test_hf_without_datasets_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"needs the optional `datasets` package: pip install 'k3\[data\]'"):
        prep(cfg(tmp_path, source="hf:roneneldan/TinyStories"))


def test_txt_directory_and_max_bytes(tmp_path):
    src = write_txt(tmp_path / "txt", n=8)
    data = prep(cfg(tmp_path, source=str(src), val_fraction=0.25, max_bytes=1500))
    assert data.meta["n_bytes"] <= 1500
    got = docs_of(data.tokenizer, data.train) + docs_of(data.tokenizer, data.val)
    full = [(src / f"doc{i}.txt").read_text() for i in range(8)]
    assert all(any(f.startswith(g) for f in full) for g in got) and len(got) < 8


# ---- BatchLoader


def arange_shard(n, name="train"):
    return TokenShard(name, np.arange(n, dtype=np.uint32), None)


def test_loader_covers_each_window_once_per_epoch():
    T, B, n = 4, 3, 4 * 10 + 1  # 10 windows
    ld = BatchLoader(arange_shard(n), batch_size=B, seq_len=T, seed=7)
    starts = [int(r[0]) for _ in range(10) for r in ld.next_batch()[0]]  # 30 windows = 3 epochs
    epochs = [starts[i:i + 10] for i in (0, 10, 20)]
    assert all(sorted(e) == list(range(0, 40, 4)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] == [4 * int(w) for w in np.random.default_rng(7).permutation(10)]
    x, m = BatchLoader(arange_shard(n), batch_size=B, seq_len=T, seed=7).next_batch()
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(B, T, dtype=torch.int64)) and m.all()


def test_loader_resume_is_exact():
    shard = TokenShard("train", np.arange(7 * 8 + 1, dtype=np.uint16),
                       np.random.default_rng(0).integers(0, 2, 7 * 8 + 1).astype(np.uint8))
    ref = BatchLoader(shard, batch_size=3, seq_len=8, seed=11)
    full = ref.take(12)  # crosses several epoch ends (7 windows per epoch)
    for k in (0, 2, 5, 7):
        ld = BatchLoader(shard, batch_size=3, seq_len=8, seed=11)
        ld.take(k)
        state = json.loads(json.dumps(ld.state_dict()))
        fresh = BatchLoader(shard, batch_size=3, seq_len=8, seed=11)
        fresh.load_state_dict(state)
        for (x, m), (x2, m2) in zip(fresh.take(12 - k), full[k:]):
            assert torch.equal(x, x2) and torch.equal(m, m2)
    twin = BatchLoader(shard, batch_size=3, seq_len=8, seed=11)
    assert all(torch.equal(next(twin)[0], x) for x, _ in full[:3])  # the iterator protocol gives the same stream
    assert iter(twin) is twin and torch.equal(next(iter(twin))[0], full[3][0])
    with pytest.raises(DataError, match="seed"):
        BatchLoader(shard, batch_size=3, seq_len=8, seed=12).load_state_dict(state)
    with pytest.raises(DataError, match="n_windows"):
        BatchLoader(shard, batch_size=3, seq_len=4, seed=11).load_state_dict({**state, "seq_len": 4})


def test_loader_small_data_wraps_and_too_small_errors():
    ld = BatchLoader(arange_shard(9), batch_size=5, seq_len=4, seed=0)  # 2 windows < batch
    x, _ = ld.next_batch()
    assert x.shape == (5, 5) and sorted(set(x[:, 0].tolist())) == [0, 4]
    with pytest.raises(DataError, match="val split has 4 tokens, fewer than seq_len \\+ 1 = 5"):
        BatchLoader(arange_shard(4, "val"), batch_size=1, seq_len=4)


def test_val_mode_is_sequential_and_fixed():
    ld = BatchLoader(arange_shard(4 * 7 + 1, "val"), batch_size=3, seq_len=4, mode="val")
    first = ld.take(2)
    assert [r[0] for x, _ in first for r in x.tolist()] == [0, 4, 8, 12, 16, 20]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ld.take(2), first))
    every = list(ld)
    assert [len(x) for x, _ in every] == [3, 3, 1] and len(ld.take(50)) == 3


# ---- errors


@pytest.mark.parametrize("source, match", [
    ("{tmp}/missing.txt", "missing.txt does not exist"),
    ("{tmp}/*.nothing", "the glob matched no files"),
    ("{tmp}", "no .txt/.jsonl/.parquet files under"),
])
def test_missing_sources(tmp_path, source, match):
    with pytest.raises(DataError, match=match):
        prep(cfg(tmp_path, source=source.format(tmp=tmp_path)))


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=f"{p}:4: invalid JSON"):
        prep(cfg(tmp_path, source=str(p)))
    p.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=f"{p}:2: no string 'text'"):
        prep(cfg(tmp_path, source=str(p)))
    p.write_text('{"text": "ok"}\n{"text": "  "}\n')
    with pytest.raises(DataError, match=f"{p}:2: empty document"):
        prep(cfg(tmp_path, source=str(p)))


def test_files_without_a_document_are_skipped_counted_and_named(tmp_path, capsys):
    d = write_txt(tmp_path / "txt", n=4)
    (d / "empty.txt").write_text("\n")
    (d / "none.jsonl").write_text("\n\n")
    full = prep(cfg(tmp_path, source=str(write_txt(tmp_path / "clean", n=4))))
    capsys.readouterr()
    for cache in ("c1", "c1"):  # a fresh cache entry, then a cache hit: the warning both times
        data = prep(cfg(tmp_path, source=str(d), cache_dir=str(tmp_path / cache)))
        assert data.meta["skipped"] == [str(d / "empty.txt"), str(d / "none.jsonl")]
        err = capsys.readouterr().err
        assert err.startswith("warning: data.source: skipped 2 of 6 files that hold no document: ")
        assert f"{d / 'empty.txt'}, {d / 'none.jsonl'} (all listed in " in err and err.count("\n") == 1, err
        assert data.train.n_tokens + data.val.n_tokens == full.train.n_tokens + full.val.n_tokens
    for f in d.glob("doc*.txt"):
        f.write_text("  \n")
    with pytest.raises(DataError, match=r"no usable file; every file read holds no document: .*doc0.txt, .* and 3 "
                                        r"more; add text to them"):
        prep(cfg(tmp_path, source=str(d), cache_dir=str(tmp_path / "c2")))


def test_other_clear_errors(tmp_path, monkeypatch):
    d = write_txt(tmp_path / "txt", n=2)
    (d / "empty.txt").write_bytes(b"\xff\xfe bad")
    with pytest.raises(DataError, match="empty.txt: not UTF-8"):
        prep(cfg(tmp_path, source=str(d)))
    (d / "empty.txt").unlink()
    (d / "notes.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        prep(cfg(tmp_path, source=str(d / "*")))
    with pytest.raises(DataError, match="holds one document"):
        prep(cfg(tmp_path, source=str(d / "doc0.txt")))
    one = prep(cfg(tmp_path, source=str(d / "doc0.txt"), val_fraction=0.0))
    assert one.val.n_tokens == 0 and one.meta["val_bytes_per_token"] is None
    with pytest.raises(ConfigError, match="data.vocab_size=600 exceeds model.vocab_size=512"):
        prep(cfg(tmp_path, source=str(d), vocab_size=600))
    with pytest.raises(ValueError, match="at least 260"):
        prep(cfg(tmp_path, source=str(d), vocab_size=100))
    real_read = Path.read_text

    def unreadable(self, *a, **kw):  # chmod 000 does not stop root, so fail the read the way the OS would
        if self.name == "doc1.txt":
            raise PermissionError(13, "Permission denied")
        return real_read(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", unreadable)
    with pytest.raises(DataError, match="doc1.txt: cannot read \\(Permission denied\\)"):
        prep(cfg(tmp_path, source=str(d / "*.txt"), cache_dir=str(tmp_path / "c2")))


def test_small_corpus_still_gets_a_val_document_and_sample_is_capped(tmp_path):
    src = write_txt(tmp_path / "txt", n=5)
    data = prep(cfg(tmp_path, source=str(src)))  # default val_fraction 0.05 of 5 files rounds to none
    assert data.meta["splits"]["val"]["n_docs"] == 1 and data.meta["splits"]["train"]["n_docs"] == 4
    fs = _FileSource(str(src))
    plan = _make_plan(fs, 0.05, None, "x")
    sample = list(_tokenizer_sample(fs, plan, 1000))
    assert 997 <= sum(len(t.encode()) for t in sample) <= 1000  # a cut multi-byte character may drop <= 3 bytes
    assert sample == list(_tokenizer_sample(fs, plan, 1000))
    train_text = "".join(r.text for r in _split_records(fs, plan, "train"))
    assert all(t in train_text for t in sample)  # sampled from the training split only
