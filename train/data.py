"""Data for `k3 pretrain`: text sources -> byte-level BPE tokenizer -> cached token shards -> batches.

Legend: B batch (sequences), T seq_len, N tokens in a shard.

- Sources (`DataConfig.source`): "stdlib" (the running interpreter's standard-library .py files, not site-packages),
  a local .txt / .jsonl / .parquet file, directory or glob, or "hf:NAME" (optional `datasets`). A .txt file is one
  document; a .jsonl line / .parquet row holds `text`, or `prompt` + `completion` (loss on the completion only);
  a .jsonl line may hold `messages` instead (a chat ending in an assistant turn: the ChatML turns before it and
  "<|im_start|>assistant\n" are the prompt, that turn's content and "<|im_end|>" the completion, special tokens
  parsed).
- Split by file (.py/.txt) or by document (.jsonl/.parquet/hf rows): a record is held out when a hash of its key
  (relative path, or path:line) is below `val_fraction`; at least one record lands on each side. `max_bytes` takes
  records in a fixed order (files in hash order: a capped corpus is spread out, not the alphabetically first files)
  and truncates the one crossing the cap.
- Shards in `cache_dir/<key>/`: train.bin / val.bin (uint16 if the vocab fits, else uint32), *_mask.bin (uint8,
  only when some targets are masked), meta.json, the tokenizer; key = hash(source manifest of paths, sizes, mtimes;
  tokenizer hash; val_fraction; max_bytes). Each document is preceded by `<|endoftext|>` and the shard ends with
  one, so the model learns to end documents; mask 1 at token j means "predicting token j counts".
- BatchLoader: windows of T+1 tokens at stride T, shuffled per epoch with seed + epoch; exact resume.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import io
import json
import os
import shutil
import sys
import sysconfig
import time
import tokenize
import uuid
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import tokenizers
import torch
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from k3.model.config import ConfigError
from k3.model.tokenizer import IM_END, K3Tokenizer, chatml, train_bpe

from .config import DataConfig
from .console import make_console

CACHE_FORMAT = 1  # bump when the shard layout or tokenization rules change: old cache entries are then ignored
SUPPORTED = (".txt", ".jsonl", ".parquet")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # third-party code is not the standard library
_FLUSH_BYTES = 4 << 20  # text bytes per encode_batch call: big enough for the Rust thread pool, small for memory


class DataError(ValueError):
    """A data source or cache problem; the message names the path and the fix."""


class _Record(NamedTuple):
    key: str  # identity for the split and sampling hashes (relative path, or "path:line")
    text: str  # the document, or the prompt of a prompt/completion pair
    completion: str | None = None
    chat: bool = False  # ChatML rendered from `messages`: encoded with the special tokens parsed

    def nbytes(self) -> int:
        return len(self.text.encode("utf-8")) + (len(self.completion.encode("utf-8")) if self.completion else 0)


def _unit_hash(salt: str, key: str) -> float:
    """Deterministic hash of `key` mapped to [0, 1); the salt makes the split, order and sample independent."""
    h = hashlib.blake2b(f"{salt}\0{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _digest(obj) -> str:  # cache keys
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _truncate(text: str, nbytes: int) -> str:
    # errors="ignore" only drops a multi-byte character cut in half at the end (the rest came from a valid str)
    return text.encode("utf-8")[:nbytes].decode("utf-8", errors="ignore")


class _StdlibSource:
    """The standard library's .py files, test/ included (real Python). Empty files are skipped, and so are files
    whose declared encoding does not decode (a few deliberate test fixtures; listed in meta["skipped"]).
    Like every source, it yields the same records in the same order on every call."""

    def __init__(self):
        self.root = Path(sysconfig.get_paths()["stdlib"])
        files = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
            files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
        if not files:
            raise DataError(f"data.source 'stdlib': no .py files under {self.root}; this Python has no standard "
                            f"library sources installed, use a local path or 'hf:NAME' as data.source")
        self.rels = rels = {f: f.relative_to(self.root).as_posix() for f in files}
        self.files = sorted(files, key=lambda f: _unit_hash("order", rels[f]))
        self.skipped: set[str] = set()
        self.manifest = {"kind": "stdlib", "python": sys.version, "root": str(self.root),
                         "files": sorted([rels[f], f.stat().st_size, f.stat().st_mtime_ns] for f in files)}

    def records(self) -> Iterator[_Record]:
        for f in self.files:
            data = f.read_bytes()
            try:
                enc, _ = tokenize.detect_encoding(io.BytesIO(data).readline)  # PEP 263 coding declaration
                text = data.decode(enc)
            except (SyntaxError, UnicodeDecodeError, LookupError):
                self.skipped.add(self.rels[f])
                continue
            if text.strip():
                yield _Record(self.rels[f], text)


class _FileSource:
    """Local .txt (one document per file), .jsonl and .parquet files. A blank .txt file or a .jsonl file without a
    document is skipped (listed in meta["skipped"], with a warning): one stray empty file in a corpus of hundreds
    is not worth stopping for."""

    def __init__(self, source: str):
        files = _local_files(source)
        root = Path(os.path.commonpath([f.parent for f in files]))
        self.rels = {f: f.relative_to(root).as_posix() for f in files}
        self.files = sorted(files, key=lambda f: _unit_hash("order", self.rels[f]))
        self.manifest = {"kind": "files", "files": [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
        self.skipped: set[str] = set()  # the full paths of the files without a document

    def records(self) -> Iterator[_Record]:
        for f in self.files:
            ext = f.suffix.lower()
            if ext == ".txt":
                try:
                    text = f.read_text(encoding="utf-8-sig")
                except UnicodeDecodeError as e:
                    raise DataError(f"{f}: not UTF-8 text (byte {e.start}: {e.reason}); re-encode it as UTF-8 "
                                    f"(e.g. iconv -t utf-8) or remove it from data.source") from e
                except OSError as e:
                    raise DataError(f"{f}: cannot read ({e.strerror}); check its permissions") from e
                if not text.strip():
                    self.skipped.add(str(f))
                    continue
                yield _Record(self.rels[f], text)
            elif ext == ".jsonl":
                n = yield from _jsonl_records(f, self.rels[f])
                if n == 0:
                    self.skipped.add(str(f))
            else:
                yield from _parquet_records(f, self.rels[f])


def _local_files(source: str) -> list[Path]:
    """Resolve a file, directory (searched recursively) or glob to a sorted list of supported files."""
    s = os.path.expanduser(source)
    fix = "pass an existing .txt/.jsonl/.parquet file, a directory or a glob (quoted), 'stdlib' or 'hf:NAME'"
    p = Path(s).resolve()
    if any(c in s for c in "*?["):
        files = sorted(Path(f).resolve() for f in glob.glob(s, recursive=True) if Path(f).is_file())
        if not files:
            raise DataError(f"data.source {source!r}: the glob matched no files; {fix}")
    elif not p.exists():
        raise DataError(f"data.source {source!r}: {p} does not exist; {fix}")
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUPPORTED)
        if not files:
            raise DataError(f"data.source {source!r}: no {'/'.join(SUPPORTED)} files under {p}; {fix}")
    else:
        files = [p]
    bad = [str(f) for f in files if f.suffix.lower() not in SUPPORTED]
    if bad:
        raise DataError(f"data.source {source!r}: unsupported file type {', '.join(bad[:3])}"
                        f"{' ...' if len(bad) > 3 else ''}; k3 reads {', '.join(SUPPORTED)}; narrow the glob")
    return files


def _record_from_obj(obj, where: str, key: str) -> _Record:
    """A jsonl object / parquet row -> record. `where` ("path:line") names the place in errors."""
    hint = 'expected {"text": "..."}, {"prompt": "...", "completion": "..."} or {"messages": [...]}'
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}; {hint}")
    text, prompt, completion = obj.get("text"), obj.get("prompt"), obj.get("completion")
    if isinstance(text, str):
        if not text.strip():
            raise DataError(f"{where}: empty document ('text' is blank); remove the line")
        return _Record(key, text)
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            raise DataError(f"{where}: empty 'completion' (it is the only part that is trained on); remove the line")
        return _Record(key, prompt, completion)
    msgs = obj.get("messages")
    if isinstance(msgs, list) and msgs:
        last = msgs[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant" or not str(last.get("content", "")).strip():
            raise DataError(f"{where}: 'messages' must end with a non-empty assistant turn (it is the part trained "
                            f"on); the last is {last!r}")
        try:
            return _Record(key, chatml(msgs[:-1]), f"{last['content']}{IM_END}", chat=True)
        except TypeError as e:
            raise DataError(f"{where}: {e}") from None
    raise DataError(f"{where}: no string 'text', 'prompt' + 'completion' or 'messages' (keys: {sorted(obj)}); "
                    f"{hint}")


def _jsonl_records(path: Path, rel: str) -> Generator[_Record, None, int]:
    """The file's records; returns how many there were."""
    n = 0
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue  # blank lines (e.g. a trailing newline) carry no document
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); each line "
                                    f"must be one JSON object; fix or delete the line") from e
                yield _record_from_obj(obj, f"{path}:{lineno}", f"{rel}:{lineno}")
                n += 1
    except (UnicodeDecodeError, OSError) as e:
        raise DataError(f"{path}: cannot read it as UTF-8 text ({e}); check its permissions and encoding") from e
    return n


def _parquet_records(path: Path, rel: str) -> Iterator[_Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"{path}: reading .parquet needs pyarrow: pip install 'k3[data]'") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError variants for damaged files
        raise DataError(f"{path}: not a readable parquet file ({e}); re-export it or remove it") from e
    names = pf.schema_arrow.names
    cols = ["text"] if "text" in names else ["prompt", "completion"]
    if not set(cols) <= set(names):
        raise DataError(f"{path}: needs a 'text' column (or 'prompt' and 'completion'); it has {names}")
    row = 0
    for batch in pf.iter_batches(columns=cols, batch_size=4096):
        for obj in batch.to_pylist():
            yield _record_from_obj(obj, f"{path} row {row}", f"{rel}:{row}")
            row += 1


class _HFSource:
    """A Hugging Face dataset through the optional `datasets` package; one row = one document."""

    def __init__(self, cfg: DataConfig):
        name = cfg.source[3:]
        try:
            import datasets
        except ImportError as e:
            raise DataError(f"data.source {cfg.source!r} needs the optional `datasets` package: "
                            f"pip install 'k3[data]'") from e
        try:
            self.ds = datasets.load_dataset(name, split=cfg.hf_split)
        except Exception as e:  # network, auth and missing-dataset errors come as many types; report them all alike
            raise DataError(f"data.source {cfg.source!r}: could not load split {cfg.hf_split!r} ({e}). Offline? "
                            f"Download it once while online (it is then cached; set HF_DATASETS_OFFLINE=1), or "
                            f"export it to .jsonl/.parquet and pass that path") from e
        self.field = cfg.hf_text_field
        if self.field not in self.ds.column_names:
            raise DataError(f"data.source {cfg.source!r}: no column {self.field!r} (columns: {self.ds.column_names});"
                            f" set data.hf_text_field")
        self.manifest = {"kind": "hf", "name": name, "split": cfg.hf_split, "field": self.field,
                         "fingerprint": getattr(self.ds, "_fingerprint", None), "rows": len(self.ds)}

    def records(self) -> Iterator[_Record]:
        i = 0
        for batch in self.ds.select_columns([self.field]).iter(batch_size=1024):
            for text in batch[self.field]:
                if isinstance(text, str) and text.strip():  # hub datasets commonly hold a few empty rows
                    yield _Record(str(i), text)
                i += 1


class _Plan(NamedTuple):
    """Which records are used (max_bytes) and which are held out."""
    n_records: int  # records used, in source order
    cut_bytes: int | None  # the last used record is truncated to this many bytes (max_bytes), else None
    val: set[int]  # indices of validation records
    split_bytes: dict[str, int]  # text bytes of "train" and "val"


def _make_plan(src, val_fraction: float, max_bytes: int | None, source_name: str) -> _Plan:
    hashes, sizes, total, cut = [], [], 0, None
    for rec in src.records():
        b = rec.nbytes()
        if max_bytes is not None and total + b > max_bytes:
            room = max_bytes - total
            if rec.completion is not None or room <= 0:  # a prompt/completion pair is never cut in half
                break
            cut, b = room, len(_truncate(rec.text, room).encode("utf-8"))
        hashes.append(_unit_hash("split", rec.key))
        sizes.append(b)
        total += b
        if cut is not None:
            break
    if (n := len(hashes)) == 0 and isinstance(src, _FileSource) and src.skipped:
        raise DataError(f"data.source {source_name!r}: no usable file; every file read holds no document: "
                        f"{_few(sorted(src.skipped))}; add text to them or point data.source at other files")
    if n == 0:
        raise DataError(f"data.source {source_name!r}: no documents to read (data.max_bytes={max_bytes}); "
                        f"raise data.max_bytes or add data")
    val = {i for i, h in enumerate(hashes) if h < val_fraction}
    if val_fraction > 0:
        if n < 2:
            raise DataError(f"data.source {source_name!r} holds one document, so none can be held out for "
                            f"validation; add documents (a .txt file is one document), or set data.val_fraction=0")
        if not val:  # small corpora: still evaluate on something, chosen by the same hash
            val = {int(np.argmin(hashes))}
        if len(val) == n:
            val.discard(int(np.argmax(hashes)))
    val_bytes = sum(sizes[i] for i in val)
    return _Plan(n, cut, val, {"train": sum(sizes) - val_bytes, "val": val_bytes})


def _split_records(src, plan: _Plan, split: str) -> Iterator[_Record]:
    want_val = split == "val"
    for i, rec in enumerate(src.records()):
        if i >= plan.n_records:
            break
        if (i in plan.val) != want_val:
            continue
        if i == plan.n_records - 1 and plan.cut_bytes is not None:
            rec = _Record(rec.key, _truncate(rec.text, plan.cut_bytes))
        yield rec


def _tokenizer_sample(src, plan: _Plan, sample_bytes: int) -> Iterator[str]:
    """Up to `sample_bytes` of training text: first the documents a hash test keeps at the rate sample/total (a
    spread-out sample), then, if that fell short (few large documents), the others in order until the cap."""
    rate = min(1.0, sample_bytes / max(plan.split_bytes["train"], 1))
    taken = 0
    for second_pass in (False, True) if rate < 1.0 else (False,):
        for rec in _split_records(src, plan, "train"):
            if rate < 1.0 and (_unit_hash("sample", rec.key) < rate) == second_pass:
                continue
            text = rec.text + (rec.completion or "")
            b = len(text.encode("utf-8"))
            if taken + b > sample_bytes:
                text, b = _truncate(text, sample_bytes - taken), sample_bytes - taken
            if text:
                yield text
            taken += b
            if taken >= sample_bytes:
                return


@dataclass
class TokenShard:
    """One split's tokens: `tokens` [N] (uint16/uint32 memmap) and `loss_mask` [N] uint8 (1 = predicting this token
    counts) or None when every target counts."""

    name: str
    tokens: np.ndarray
    loss_mask: np.ndarray | None
    path: Path | None = None

    @property
    def n_tokens(self) -> int:  # N
        return int(self.tokens.shape[0])


@dataclass
class PreparedData:
    """Output of `prepare_data`: the tokenizer, both shards and meta.json (plus `val_bytes_per_token`)."""

    tokenizer: K3Tokenizer
    train: TokenShard
    val: TokenShard
    meta: dict
    cache_dir: Path


def _write_split(tok: K3Tokenizer, records: Iterator[_Record], out: Path, split: str, dtype, prog, task) -> dict:
    """Tokenize `records` into out/{split}.bin (+ {split}_mask.bin if any target is masked); return split stats."""
    eot = tok.eos_id
    st = {"n_docs": 0, "n_bytes": 0, "n_loss_bytes": 0, "n_tokens": 0, "n_loss_tokens": 0, "has_mask": False}
    mask_path = out / f"{split}_mask.bin"
    with open(out / f"{split}.bin", "wb") as ft, open(mask_path, "wb") as fm:

        def write(batch: list[_Record], tail: list[int]):
            def parts(chat: bool) -> list[str]:
                return [t for r in batch if r.chat == chat
                        for t in ((r.text, r.completion) if r.completion is not None else (r.text,))]
            plain = iter(tok.encode_batch(parts(False), parse_special=False))
            chats = iter(tok.encode_batch(parts(True), parse_special=True) if any(r.chat for r in batch) else [])
            ids, mask = [], []
            for r in batch:
                encoded = chats if r.chat else plain
                first = next(encoded)
                ids += [eot, *first]
                if r.completion is None:
                    mask += [1] * (1 + len(first))
                else:  # predicting the separator counts (it ends the previous document); the prompt does not
                    comp = next(encoded)
                    ids += comp
                    mask += [1] + [0] * len(first) + [1] * len(comp)
                    st["has_mask"] = True
            ids, mask = ids + tail, mask + [1] * len(tail)
            np.asarray(ids, dtype=dtype).tofile(ft)
            np.asarray(mask, dtype=np.uint8).tofile(fm)
            st["n_tokens"] += len(ids)
            st["n_loss_tokens"] += sum(mask)

        batch, nb = [], 0
        for rec in records:
            b = rec.nbytes()
            st["n_docs"], st["n_bytes"] = st["n_docs"] + 1, st["n_bytes"] + b
            st["n_loss_bytes"] += b if rec.completion is None else len(rec.completion.encode("utf-8"))
            batch.append(rec)
            nb += b
            if nb >= _FLUSH_BYTES:
                write(batch, [])
                prog.advance(task, nb)
                batch, nb = [], 0
        write(batch, [eot] if st["n_docs"] else [])  # the last document also gets its end marker
        prog.advance(task, nb)
    if st["n_tokens"]:
        st["n_loss_tokens"] -= 1  # token 0 (an <|endoftext|>, mask 1) is never a target
    if not st["has_mask"]:
        mask_path.unlink()
    return st


def _open_shard(d: Path, split: str, dtype: str, *, n_tokens: int, has_mask: bool, **_) -> TokenShard:
    path, mask_path = d / f"{split}.bin", d / f"{split}_mask.bin"
    if n_tokens == 0:
        return TokenShard(split, np.zeros(0, dtype=dtype), None, path)
    for p, size in [(path, n_tokens * np.dtype(dtype).itemsize)] + [(mask_path, n_tokens)] * has_mask:
        if not p.is_file() or p.stat().st_size != size:
            raise DataError(f"cache entry {d} is damaged ({p.name} missing or of the wrong size); delete it, rerun")
    mask = np.memmap(mask_path, dtype=np.uint8, mode="r", shape=(n_tokens,)) if has_mask else None
    return TokenShard(split, np.memmap(path, dtype=dtype, mode="r", shape=(n_tokens,)), mask, path)


def _load_tokenizer(cfg: DataConfig, src, plan_fn, vocab: int, cache: Path, console, show: bool) -> K3Tokenizer:
    """The configured tokenizer, or a BPE trained on the training split (cached under cache/tokenizers/<key>)."""
    if cfg.tokenizer is not None:
        return K3Tokenizer.from_file(cfg.tokenizer)
    key = _digest({"format": CACHE_FORMAT, "manifest": src.manifest, "val_fraction": cfg.val_fraction,
                   "max_bytes": cfg.max_bytes, "vocab": vocab, "sample_bytes": cfg.tokenizer_sample_bytes,
                   "tokenizers": tokenizers.__version__})
    d = cache / "tokenizers" / key
    if (d / "tokenizer.json").is_file():
        return K3Tokenizer.from_file(d)
    t0 = time.time()
    with console.status(f"training a byte-level BPE tokenizer (vocab {vocab})") if show else contextlib.nullcontext():
        tok = train_bpe(_tokenizer_sample(src, plan_fn(), cfg.tokenizer_sample_bytes), vocab)
    tmp = d.parent / f".{key}.tmp-{uuid.uuid4().hex}"
    tok.save(tmp)
    _publish(tmp, d)
    if show:
        console.print(f"trained byte-level BPE tokenizer: {tok.vocab_size} tokens in {time.time() - t0:.1f}s "
                      f"({min(cfg.tokenizer_sample_bytes, plan_fn().split_bytes['train']) / 1e6:.1f} MB sample)")
    return K3Tokenizer.from_file(d)


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished temp directory into place; if another process won the race, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_data(cfg: DataConfig, vocab_size: int, tokenizer_out_dir: str | os.PathLike | None = None, *,
                 console=None, show_progress: bool = True) -> PreparedData:
    """Resolve the source, get the tokenizer, and tokenize into cached shards (reused when the key matches).

    vocab_size: the model's vocab (used to train the BPE when data.vocab_size is None; an upper bound either way).
    tokenizer_out_dir: if given, the tokenizer files are also saved there.
    Returns PreparedData with .train / .val shards [N] and .meta (incl. `val_bytes_per_token`, for
    bits-per-byte = loss_nats_per_token / ln 2 / val_bytes_per_token).
    Example: `data = prepare_data(DataConfig(max_bytes=2_000_000), vocab_size=4096)`.
    """
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.val_fraction} must be in [0, 1)")
    for name in ("max_bytes", "tokenizer_sample_bytes"):
        if (value := getattr(cfg, name)) is not None and value <= 0:
            raise ConfigError(f"data.{name}={value} must be positive")
    vocab = int(cfg.vocab_size if cfg.vocab_size is not None else vocab_size)
    if vocab > vocab_size:
        raise ConfigError(f"data.vocab_size={vocab} exceeds model.vocab_size={vocab_size}; the embedding needs a "
                          f"row per token: lower data.vocab_size or raise model.vocab_size")
    console = console or make_console(stderr=True)
    cache = Path(cfg.cache_dir).expanduser()
    (cache / "tokenizers").mkdir(parents=True, exist_ok=True)
    src = (_StdlibSource() if cfg.source == "stdlib" else _HFSource(cfg) if cfg.source.startswith("hf:")
           else _FileSource(cfg.source))
    # reading every record to plan the split is only needed on a cache miss
    plan_fn = functools.cache(lambda: _make_plan(src, cfg.val_fraction, cfg.max_bytes, cfg.source))

    tok = _load_tokenizer(cfg, src, plan_fn, vocab, cache, console, show_progress)
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"tokenizer {tok.source} has {tok.vocab_size} tokens but model.vocab_size is "
                          f"{vocab_size}; raise model.vocab_size or use a smaller tokenizer")
    dtype = "uint16" if tok.vocab_size <= 65536 else "uint32"
    key = _digest({"format": CACHE_FORMAT, "manifest": src.manifest, "tokenizer": tok.hash(),
                   "val_fraction": cfg.val_fraction, "max_bytes": cfg.max_bytes})
    d = cache / key
    if not (d / "meta.json").is_file():
        plan = plan_fn()
        tmp = cache / f".{key}.tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            t0 = time.time()
            splits = {}
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                          TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                          disable=not show_progress) as prog:
                for split in ("train", "val"):
                    task = prog.add_task(f"tokenizing {split}", total=plan.split_bytes[split])
                    splits[split] = _write_split(tok, _split_records(src, plan, split), tmp, split, dtype, prog, task)
            seconds = time.time() - t0
            meta = {"format": CACHE_FORMAT, "key": key, "source": cfg.source, "dtype": dtype,
                    "vocab_size": tok.vocab_size, "tokenizer_hash": tok.hash(), "val_fraction": cfg.val_fraction,
                    "max_bytes": cfg.max_bytes, "n_tokens": sum(s["n_tokens"] for s in splits.values()),
                    "n_bytes": sum(s["n_bytes"] for s in splits.values()), "splits": splits, "manifest": src.manifest,
                    "skipped": sorted(getattr(src, "skipped", ())), "tokenize_seconds": round(seconds, 3)}
            tok.save(tmp / "tokenizer")
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
            _publish(tmp, d)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if show_progress:
            console.print(f"tokenized {cfg.source}: {splits['train']['n_tokens'] / 1e6:.2f}M train + "
                          f"{splits['val']['n_tokens'] / 1e6:.2f}M val tokens in {seconds:.1f}s -> {d}")
    try:
        meta = json.loads((d / "meta.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cache entry {d}: unreadable meta.json ({e}); delete {d} and run again") from e
    if meta.get("format") != CACHE_FORMAT or meta.get("tokenizer_hash") != tok.hash():
        raise DataError(f"cache entry {d} does not match this k3 version or tokenizer; delete {d} and run again")
    if meta["manifest"]["kind"] == "files" and meta["skipped"]:
        print(f"warning: data.source: skipped {len(meta['skipped'])} of {len(meta['manifest']['files'])} files that "
              f"hold no document: {_few(meta['skipped'])} (all listed in {d / 'meta.json'})", file=sys.stderr)
    for s, st in meta["splits"].items():
        meta[f"{s}_bytes_per_token"] = st["n_loss_bytes"] / st["n_loss_tokens"] if st["n_loss_tokens"] else None
    train, val = (_open_shard(d, s, meta["dtype"], **meta["splits"][s]) for s in ("train", "val"))
    if tokenizer_out_dir is not None:
        tok.save(tokenizer_out_dir)
    return PreparedData(tok, train, val, meta, d)


class BatchLoader:
    """Batches of windows from one shard: tokens [B, T+1] int64 (inputs tokens[:, :-1], targets tokens[:, 1:]) and
    loss_mask [B, T] bool (True where the target counts).

    Windows start at multiples of T and hold T+1 tokens, so consecutive windows share one token and every target
    appears once per epoch. mode="train": an infinite stream; window order is a permutation drawn with seed + epoch,
    and batches run on across epoch ends (so a shard with fewer windows than B still works). mode="val": the windows
    in order from the start on every iteration, the last batch possibly shorter, never repeating a window.
    Example: `x, m = BatchLoader(data.train, batch_size=8, seq_len=256, seed=1234).next_batch()`.
    """

    def __init__(self, shard: TokenShard, *, batch_size: int, seq_len: int, seed: int = 0, mode: str = "train"):
        if mode not in ("train", "val") or batch_size < 1 or seq_len < 1:
            raise ValueError(f"need mode 'train' or 'val' (got {mode!r}), batch_size >= 1 (got {batch_size}) and "
                             f"seq_len >= 1 (got {seq_len})")
        if shard.n_tokens < seq_len + 1:
            raise DataError(f"the {shard.name} split has {shard.n_tokens} tokens, fewer than seq_len + 1 = "
                            f"{seq_len + 1}; lower data.seq_len, add data, or raise data.max_bytes/val_fraction")
        self.shard, self.batch_size, self.seq_len, self.seed, self.mode = shard, batch_size, seq_len, seed, mode
        self.n_windows = (shard.n_tokens - 1) // seq_len
        self.epoch, self.pos = 0, 0  # next window = permutation(epoch)[pos]
        self._order = functools.lru_cache(maxsize=1)(  # one epoch's window order, drawn once
            lambda epoch: np.random.default_rng(self.seed + epoch).permutation(self.n_windows))

    def _gather(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        starts = windows.astype(np.int64) * T
        tokens_BT1 = np.stack([self.shard.tokens[s:s + T + 1] for s in starts]).astype(np.int64)
        if self.shard.loss_mask is None:
            mask_BT = np.ones((len(starts), T), dtype=bool)
        else:
            mask_BT = np.stack([self.shard.loss_mask[s + 1:s + T + 1] for s in starts]).astype(bool)
        return torch.from_numpy(tokens_BT1), torch.from_numpy(mask_BT)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Train mode: the next (tokens [B, T+1], loss_mask [B, T]); advances the state."""
        if self.mode != "train":
            raise RuntimeError("next_batch() is for mode='train'; iterate or take(n) a val loader")
        picked, need = [], self.batch_size
        while need:
            take = self._order(self.epoch)[self.pos:self.pos + need]
            picked.append(take)
            need -= len(take)
            self.pos += len(take)
            if self.pos >= self.n_windows:
                self.epoch, self.pos = self.epoch + 1, 0
        return self._gather(np.concatenate(picked))

    def take(self, n: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Train: the next n batches. Val: the first n batches (all windows if n is None or too large)."""
        if self.mode == "val":
            return list(self._val_batches(n))
        if n is None:
            raise ValueError("take(None) needs mode='val'; a train loader is infinite")
        return [self.next_batch() for _ in range(n)]

    def _val_batches(self, n: int | None):
        B = self.batch_size
        n_windows = self.n_windows if n is None else min(self.n_windows, n * B)
        for lo in range(0, n_windows, B):
            yield self._gather(np.arange(lo, min(lo + B, n_windows)))

    def __iter__(self):  # train: the loader itself, an endless iterator; val: a fresh pass over the windows
        return self._val_batches(None) if self.mode == "val" else self

    __next__ = next_batch

    def state_dict(self) -> dict:
        """JSON-able position in the stream; `load_state_dict` on a loader over the same shard continues exactly."""
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "seq_len": self.seq_len,
                "n_windows": self.n_windows, "n_tokens": self.shard.n_tokens}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by `state_dict`; the data, seq_len and seed must be those of the saved run."""
        current = self.state_dict()
        for k in ("seed", "seq_len", "n_windows", "n_tokens"):
            if state.get(k) != (mine := current[k]):
                raise DataError(f"data loader state was saved with {k}={state.get(k)} but this run has {k}={mine}; "
                                f"resume with the same data source, tokenizer, data.seq_len and data.seed")
        if not (0 <= int(state["pos"]) < self.n_windows and int(state["epoch"]) >= 0):
            raise DataError(f"data loader state has an invalid position {state}; the checkpoint is damaged")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


class PasskeyMixLoader:
    """A train BatchLoader whose rows are each replaced, with probability `fraction`, by synthetic passkey documents
    (k3.train.passkey) packed back to back like any other documents: lengths log-uniform in [max(64, the shortest
    the tokenizer allows), T+1] (the last one takes the rest of the row), each with its key at a uniform random depth and its filler a random window of
    the same shard; every target of such a row counts. Short documents put many retrievals into one row (a single
    1,024-token document holds 4 answer tokens), long ones reach across the row. The draws of batch n come from a
    generator seeded with (seed, n), so the mix is a pure function of the position in the stream and resumes
    exactly (state: the inner loader's and n).
    Example: `PasskeyMixLoader(BatchLoader(data.train, batch_size=8, seq_len=1024), tok, 0.1, seed=0)`.
    """

    def __init__(self, inner: BatchLoader, tokenizer: K3Tokenizer, fraction: float, *, seed: int):
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"data.passkey_fraction={fraction} must be in [0, 1]")
        if inner.mode != "train":
            raise ValueError("PasskeyMixLoader mixes a train loader (mode='train')")
        from .passkey import min_doc_length  # data is imported by every command; the generator only here

        self.min_doc = max(64, min_doc_length(tokenizer))
        if inner.seq_len + 1 < self.min_doc:
            raise ConfigError(f"data.passkey_fraction needs data.seq_len >= {self.min_doc - 1} (the passkey "
                              f"documents of this tokenizer), got {inner.seq_len}; set data.passkey_fraction=0")
        self.inner, self.tok, self.fraction, self.seed = inner, tokenizer, fraction, seed
        self.batches = 0  # batches drawn so far

    def _row(self, n: int, rng: np.random.Generator) -> list[int]:
        from .passkey import make_passkey_doc

        row: list[int] = []
        lo, hi = np.log(self.min_doc), np.log(n)
        while len(row) < n:
            left = n - len(row)
            L = int(np.exp(rng.uniform(lo, hi))) if left > self.min_doc else left
            L = left if left - L < self.min_doc else L
            row += make_passkey_doc(self.tok, self.inner.shard.tokens, L, float(rng.random()), rng,
                                    with_answer=True).tokens
        return row

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens_BT1, mask_BT = self.inner.next_batch()
        rng = np.random.default_rng([self.seed, self.batches])
        for r in range(tokens_BT1.shape[0]):
            if rng.random() < self.fraction:
                tokens_BT1[r] = torch.tensor(self._row(tokens_BT1.shape[1], rng))
                mask_BT[r] = True
        self.batches += 1
        return tokens_BT1, mask_BT

    def __iter__(self):
        return self

    __next__ = next_batch

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), "passkey_fraction": self.fraction, "passkey_batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        if state.get("passkey_fraction") != self.fraction:
            raise DataError(f"data loader state was saved with passkey_fraction={state.get('passkey_fraction')} but "
                            f"this run has {self.fraction}; resume with the same data.passkey_fraction")
        self.inner.load_state_dict(state)
        self.batches = int(state["passkey_batches"])
