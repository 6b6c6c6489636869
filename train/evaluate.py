"""`k3 eval passkey` and `k3 eval loss`: long-context evaluation of any release k3 writes (quantized ones included).

- passkey: for each length L and depth d, `trials` documents of exactly L tokens from k3.train.passkey (filler: a
  random window of the validation split of the checkpoint's own data source), a greedy completion of each through
  the inference path the caller passes in (`generate`: k3.serve.generate.generate_batch, prefill + recurrent
  decode), scored by exact match. Output: passkey.json, passkey.png (accuracy heat map, lengths on x, depths on y).
- loss: validation CE over `batches` batches of windows of seq_len tokens, bits per byte, and the CE of the
  targets at input positions [0, 1), [1, 2), [2, 4), ..., [T/2, T) (powers of two), whose token-weighted mean is
  the overall loss: falling loss at late positions means later tokens use earlier context. Output: loss.json,
  loss.png.

Legend: B batch, T sequence length, N tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import yaml

from k3.model.checkpoint import trained_seq_len
from k3.model.config import ConfigError
from k3.model.tokenizer import K3Tokenizer

from .config import DataConfig
from .data import BatchLoader, PreparedData, prepare_data
from .loop import token_losses
from .passkey import make_passkey_doc, passkey_correct

ANSWER_TOKENS = 8  # greedy tokens generated per passkey prompt: a 5-digit key takes at most 6 with its space
# data settings a run records that select the same text and validation split again
_DATA_KEYS = ("source", "hf_split", "hf_text_field", "val_fraction", "max_bytes", "cache_dir")


def run_data_config(ckpt: str | Path, source: str | None = None) -> DataConfig:
    """The data section of the run that trained `ckpt` (k3_run.yaml, through parent_run for quantized or extended
    releases), with the checkpoint's own tokenizer; `source` replaces the text source. Defaults where none is
    recorded. Example: run_data_config("runs/tiny/final").source  # "stdlib" """
    ckpt = Path(ckpt)
    recorded: dict = {}
    run_path = ckpt / "k3_run.yaml"
    run = yaml.safe_load(run_path.read_text(encoding="utf-8")) if run_path.is_file() else None
    while isinstance(run, dict) and not recorded:
        recorded = ((run.get("config") or {}).get("data")) or {}
        run = run.get("parent_run")
    fields = {k: recorded[k] for k in _DATA_KEYS if k in recorded}
    if source is not None:
        fields["source"] = source
        fields.pop("max_bytes", None)  # a cap chosen for another source
    return DataConfig(**fields, tokenizer=str(ckpt / "tokenizer.json"))


def eval_data(ckpt: str | Path, vocab_size: int, source: str | None = None, console=None) -> PreparedData:
    """The tokenized text `ckpt` is evaluated on (cached like pretraining's shards)."""
    if not (Path(ckpt) / "tokenizer.json").is_file():
        raise ConfigError(f"{ckpt}: no tokenizer.json beside the weights; evaluation needs the checkpoint's "
                          f"tokenizer (every release k3 writes has one)")
    return prepare_data(run_data_config(ckpt, source), vocab_size, console=console, show_progress=console is not None)


# ---------------------------------------------------------------------------------------------------- passkey


def passkey_eval(tok: K3Tokenizer, filler_N: np.ndarray, generate: Callable[..., list[list[int]]], *,
                 lengths: list[int], depths: list[float], trials: int, seed: int,
                 on_finish: Callable[[int], None] | None = None) -> dict:
    """Score `trials` passkey prompts per (length, depth). `generate(prompts, max_tokens, on_finish)` returns the
    greedy new token ids of each prompt. Returns the passkey.json mapping: accuracy[depth index][length index],
    by_length, overall, and every trial (key, needle position, completion, correct).
    The document of (length, depth, trial) depends only on (seed, length, depth, trial)."""
    if trials < 1 or not lengths or not depths:
        raise ConfigError("k3 eval passkey needs at least one length, one depth and --trials >= 1")
    rows = []
    for L in lengths:
        for d in depths:
            for t in range(trials):
                rng = np.random.default_rng([seed, L, round(d * 1_000_000), t])
                rows.append((L, d, t, make_passkey_doc(tok, filler_N, L, d, rng)))
    outs = generate([doc.tokens for *_, doc in rows], ANSWER_TOKENS, on_finish)
    detail, hits = [], np.zeros((len(depths), len(lengths)))
    for (L, d, t, doc), ids in zip(rows, outs):
        text = tok.decode(ids, skip_special_tokens=True)
        ok = passkey_correct(text, doc.key)
        hits[depths.index(d), lengths.index(L)] += ok
        detail.append({"length": L, "depth": d, "trial": t, "key": doc.key, "needle_token": doc.key_start,
                       "completion": text, "correct": ok})
    acc = hits / trials
    return {"lengths": lengths, "depths": depths, "trials": trials, "seed": seed,
            "accuracy": acc.round(6).tolist(), "by_length": dict(zip(map(str, lengths), acc.mean(0).round(6).tolist())),
            "overall": float(acc.mean()), "results": detail}


def plot_passkey(result: dict, path: Path, title: str) -> None:
    """passkey.png: accuracy heat map, lengths on x, depths on y, each cell annotated (Agg, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    acc = np.asarray(result["accuracy"])
    fig = Figure(figsize=(1.2 + 1.1 * acc.shape[1], 1.4 + 0.55 * acc.shape[0]), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
    ax.set_xticks(range(acc.shape[1]), [str(x) for x in result["lengths"]])
    ax.set_yticks(range(acc.shape[0]), [f"{d:g}" for d in result["depths"]])
    ax.set(xlabel="length (tokens)", ylabel="depth of the key", title=title)
    for i in range(acc.shape[0]):
        for j in range(acc.shape[1]):
            ax.text(j, i, f"{acc[i, j]:.0%}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="exact-match accuracy")
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------------- loss


def position_buckets(T: int) -> list[tuple[int, int]]:
    """[0, 1), [1, 2), [2, 4), ..., up to T: input positions by power of two (the last one cut at T)."""
    out, lo = [(0, 1)], 1
    while lo < T:
        out.append((lo, min(2 * lo, T)))
        lo *= 2
    return out


@torch.no_grad()
def loss_eval(model, data: PreparedData, *, seq_len: int, batches: int, batch_size: int,
              on_batch: Callable[[], None] | None = None) -> dict:
    """Validation CE of `batches` batches of [batch_size, seq_len + 1] windows (the first ones of the split, as
    k3 pretrain's evaluation takes them), bits per byte and CE by position bucket: the loss.json mapping."""
    loader = BatchLoader(data.val, seq_len=seq_len, batch_size=batch_size, mode="val")
    device = next(model.parameters()).device
    sums, counts = np.zeros(len(position_buckets(seq_len))), np.zeros(len(position_buckets(seq_len)), dtype=np.int64)
    n_seq = 0
    for tokens, mask in loader.take(batches):
        ce_BT = token_losses(model, tokens.to(device), mask.to(device)).double().cpu().numpy()
        for b, (lo, hi) in enumerate(position_buckets(seq_len)):
            part = ce_BT[:, lo:hi]
            ok = ~np.isnan(part)
            sums[b] += part[ok].sum()
            counts[b] += int(ok.sum())
        n_seq += tokens.shape[0]
        if on_batch is not None:
            on_batch()
    total = int(counts.sum())
    loss = float(sums.sum() / max(total, 1))
    bpt = data.meta.get("val_bytes_per_token")
    return {"seq_len": seq_len, "batches": math.ceil(n_seq / batch_size), "sequences": n_seq, "tokens": total,
            "loss": loss, "bpb": loss / math.log(2) / bpt if bpt else None, "bytes_per_token": bpt,
            "buckets": [{"start": lo, "end": hi, "tokens": int(c), "loss": float(s / c) if c else None}
                        for (lo, hi), s, c in zip(position_buckets(seq_len), sums, counts)]}


def plot_loss(result: dict, path: Path, title: str, trained: int | None) -> None:
    """loss.png: CE per position bucket against the bucket's first position (log2 axis), the trained length marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    pts = [(max(b["start"], 0.5), b["loss"]) for b in result["buckets"] if b["loss"] is not None]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-")
    if trained:
        ax.axvline(trained, color="grey", ls="--", label=f"trained length {trained}")
        ax.legend()
    ax.set_xscale("log", base=2)
    ax.set(xlabel="input position (bucket start; 0 drawn at 0.5)", ylabel="cross-entropy (nats/token)", title=title)
    fig.savefig(path, dpi=110)


def write_json(obj: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def checkpoint_info(ckpt: str | Path) -> dict:
    """What the outputs record about the checkpoint: its path, position mode and trained length."""
    cfg = json.loads((Path(ckpt) / "config.json").read_text(encoding="utf-8"))
    return {"checkpoint": str(ckpt), "mla_position": cfg.get("mla_position"), "rope_theta": cfg.get("rope_theta"),
            "trained_seq_len": trained_seq_len(ckpt),
            "quantization": (cfg.get("quantization_config") or {}).get("format")}


# ---------------------------------------------------------------------------------------------------- entry points


def _progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=not console.is_terminal)


def run_passkey(ckpt: str | Path, *, lengths: list[int], depths: list[float], trials: int, seed: int, out: Path,
                generate_batch: Callable[..., list[list[int]]], device: str = "cpu", console=None) -> dict:
    """`k3 eval passkey`: load, score, print the table, write passkey.json and passkey.png into `out`.
    generate_batch: k3.serve.generate.generate_batch (the CLI passes it: k3.train does not import k3.serve)."""
    from rich.table import Table

    from k3.model.checkpoint import load_model

    from .console import make_console

    console = console or make_console()
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise ConfigError(f"--depths {bad}: a depth is a fraction of the filler in [0, 1] (0 = first, 1 = last)")
    if any(L < 64 for L in lengths):
        raise ConfigError(f"--lengths {lengths}: each length must be at least 64 tokens (the needle and question "
                          f"alone take about 30)")
    info = checkpoint_info(ckpt)
    model, mcfg = load_model(ckpt, device=device)
    tok = K3Tokenizer.from_file(ckpt)
    data = eval_data(ckpt, mcfg.vocab_size)
    with _progress(console) as prog:
        task = prog.add_task("passkey", total=len(lengths) * len(depths) * trials)
        res = passkey_eval(tok, data.val.tokens, lambda p, n, cb: generate_batch(
            model, tok, p, max_tokens=n, max_num_seqs=32, max_num_batched_tokens=2048, on_finish=cb),
            lengths=lengths, depths=depths, trials=trials, seed=seed,
            on_finish=lambda i: prog.advance(task))
    res = {**info, **res}
    table = Table(title=f"passkey accuracy: {ckpt} ({info['mla_position']}, trained at "
                        f"{info['trained_seq_len'] or '?'} tokens; {trials} trials per cell)")
    table.add_column("depth \\ length", justify="right")
    for L in lengths:
        table.add_column(str(L), justify="right")
    for d, row in zip(depths, res["accuracy"]):
        table.add_row(f"{d:g}", *[f"{a:.0%}" for a in row])
    table.add_row("mean", *[f"{res['by_length'][str(L)]:.0%}" for L in lengths], style="bold")
    console.print(table)
    write_json(res, out / "passkey.json")
    plot_passkey(res, out / "passkey.png", f"passkey: {Path(ckpt).parent.name or ckpt}/{Path(ckpt).name} "
                                           f"({info['mla_position']})")
    console.print(f"wrote {out / 'passkey.json'} and {out / 'passkey.png'}")
    return res


def run_loss(ckpt: str | Path, *, source: str | None, seq_len: int | None, batches: int, out: Path,
             device: str = "cpu", console=None) -> dict:
    """`k3 eval loss`: load (any release, quantized included), evaluate, print, write loss.json and loss.png."""
    from rich.table import Table

    from k3.model.checkpoint import load_model

    from .console import make_console

    console = console or make_console()
    info = checkpoint_info(ckpt)
    T = seq_len or info["trained_seq_len"]
    if T is None:
        raise ConfigError(f"{ckpt} records no trained sequence length; pass --seq-len")
    if T < 2 or batches < 1:
        raise ConfigError(f"--seq-len {T} and --batches {batches}: need a length >= 2 and at least one batch")
    model, mcfg = load_model(ckpt, device=device)
    data = eval_data(ckpt, mcfg.vocab_size, source, console=console)
    B = max(1, 16384 // T)  # 16K tokens per forward whatever the length (1 sequence from 16K on)
    with _progress(console) as prog:
        task = prog.add_task(f"loss at {T} tokens", total=min(batches, math.ceil(((data.val.n_tokens - 1) // T) / B)))
        res = loss_eval(model, data, seq_len=T, batches=batches, batch_size=B, on_batch=lambda: prog.advance(task))
    res = {**info, "data": data.meta["source"], **res}
    table = Table(title=f"validation loss: {ckpt} at {T} tokens ({res['tokens']:,} targets)")
    for c in ("positions", "tokens", "loss"):
        table.add_column(c, justify="right")
    for b in res["buckets"]:
        table.add_row(f"[{b['start']}, {b['end']})", f"{b['tokens']:,}", f"{b['loss']:.4f}")
    table.add_row("all", f"{res['tokens']:,}", f"{res['loss']:.4f}", style="bold")
    console.print(table)
    if res["bpb"] is not None:
        console.print(f"loss {res['loss']:.4f} nats/token, {res['bpb']:.4f} bits/byte")
    write_json(res, out / "loss.json")
    plot_loss(res, out / "loss.png", f"loss by position: {Path(ckpt).parent.name}/{Path(ckpt).name}",
              info["trained_seq_len"])
    console.print(f"wrote {out / 'loss.json'} and {out / 'loss.png'}")
    return res
