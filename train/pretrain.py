"""`k3 pretrain`: data -> tokenizer -> K3Model -> Muon/AdamW loop -> training checkpoints -> release checkpoint.

RUN_DIR layout (a contract: other commands and tools read these names):
    run_config.yaml        resolved config, git sha, versions, parameter counts (`stats:`)
    metrics.jsonl          one JSON object per log step (step, loss, lr, tokens, tokens_per_s, ...) and eval lines
    tokenizer/             the tokenizer used (trained here or reused)
    checkpoints/step-N/    resumable training checkpoints (last k kept)
    final/                 release checkpoint: config.json, model.safetensors, tokenizer.json, generation_config.json,
                           k3_run.yaml
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rich.markup
import torch
import yaml
from rich.console import Console

from k3.model.checkpoint import (
    CheckpointError,
    load_release,
    load_state_into,
    read_quantization_config,
    save_release,
    trained_seq_len,
)
from k3.model.config import ConfigError, ModelConfig
from k3.model.transformer import build_model, count_parameters, describe_parameters

from .checkpoint import load_checkpoint
from .config import TrainConfig
from .console import make_console
from .data import BatchLoader, PasskeyMixLoader, prepare_data
from .loop import Trainer, TrainingError
from .optim import build_optimizer
from .parallel.checkpoint import full_model_state
from .parallel.data import RankBatchLoader
from .parallel.fsdp import check_data_parallel, shard_model
from .parallel.muon import ShardedMuonUpdate
from .parallel.runtime import (
    Distributed,
    PeerError,
    is_collective_failure,
    lost_peer_message,
    start_distributed,
    stop_distributed,
)
from .parallel.trainer import DistributedTrainer


@dataclass
class PretrainResult:
    run_dir: Path
    final_dir: Path | None  # None when stopped by a signal before the end
    step: int
    val_loss: float | None
    val_bpb: float | None
    wall_time_s: float
    tokens: int
    stop_signal: int | None = None  # the signal that stopped the run (its checkpoint saved), else None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name} but CUDA is not available; use train.device=cpu or auto")
    return dev


def check_cuda_graph(tcfg: TrainConfig, device: torch.device, *, data_parallel: bool, custom_loss: bool) -> None:
    """train.cuda_graph's preconditions (k3.train.graphs), checked before anything is written."""
    if not tcfg.cuda_graph:
        return
    fix = "set train.cuda_graph=false"
    if device.type != "cuda":
        raise ConfigError(f"train.cuda_graph=true needs a CUDA device, but training runs on {device}; {fix} or "
                          f"train on a GPU (train.device=cuda)")
    if data_parallel:
        raise ConfigError(f"train.cuda_graph=true runs on one process; with parallel.dp > 1 (FSDP2's collectives "
                          f"are not captured) {fix}")
    if tcfg.compile:
        raise ConfigError(f"train.cuda_graph=true and train.compile=true: pick one ({fix} or train.compile=false)")
    if custom_loss:
        raise ConfigError(f"train.cuda_graph=true captures the next-token objective only, not this command's own "
                          f"loss; {fix}")


def resolve_autocast(name: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default; fp32 on CPU (bf16 matmul runs ~80x slower than fp32 on these CPUs)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if name == "float32":
        return None
    if name == "bfloat16":
        return torch.bfloat16
    raise ConfigError(f"train.dtype must be auto, float32 or bfloat16, got {name!r}")


def training_flops_per_token(cfg: ModelConfig, counts: dict[str, int], seq_len: int) -> float:
    """Model FLOPs per trained token (fwd + bwd): 6 x matmul parameters touched per token + causal MLA attention.

    Matmul parameters: active parameters without the embedding table (a lookup), plus the MTP module and its second
    pass through the shared head. Attention: 6 x (qk + v head dims) x H x T / 2 per MLA layer (causal half); the
    KDA recurrence is linear in T and left out, as the usual 6N convention does.
    """
    head = cfg.d_model * cfg.vocab_size
    embed_table = 0 if cfg.tie_word_embeddings else head  # a tied matrix is the head's matmul too: keep it
    params = counts["active"] - embed_table + counts["mtp"] + (head if counts["mtp"] else 0)
    n_mla = cfg.layer_types.count("mla") + (1 if counts["mtp"] else 0)
    attn = 6 * n_mla * cfg.mla_num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len / 2
    return 6.0 * params + attn


def peak_flops_for(device: torch.device, peak_tflops: float | None) -> float | None:
    """The MFU denominator: the configured peak, else the bf16 dense datasheet peak of an H100/H200, else None."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device.type == "cuda" and any(n in torch.cuda.get_device_name(device) for n in ("H100", "H200")):
        return 989e12
    return None


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _same_architecture(a: ModelConfig, b: ModelConfig, may_differ: tuple[str, ...] = ()) -> list[str]:
    da, db = a.to_dict(), b.to_dict()
    return [k for k in da if k != "name" and k not in may_differ and da[k] != db.get(k)]


@dataclass
class InitWeights:
    """Weights to start from: a release directory (RUN_DIR/final) or a training checkpoint (RUN_DIR/checkpoints/
    step-N), with what a continued run needs to know about them."""

    path: Path
    kind: str  # "release" | "training"
    cfg: ModelConfig
    state: dict[str, torch.Tensor]
    tokenizer: str | None  # the tokenizer.json the weights were trained with, where it is found
    trained_seq_len: int | None  # the sequence length they were trained at, where it is recorded
    quantization: str | None  # the quantized format of a quantized release ("w4a8", ...), else None
    run_info: dict | None  # the resolved config they were trained with (k3_run.yaml / run_config.yaml)


def read_init(path: str | Path) -> InitWeights:
    """Read a release or training checkpoint of `k3 pretrain` / `k3 extend-context` for --init / extend-context.

    Example: read_init("runs/tiny/checkpoints/step-0000110").trained_seq_len  # 256
    """
    path = Path(path)
    if (path / "train_state.json").is_file():
        ck = load_checkpoint(path)
        rc_path = path / "run_config.yaml"
        rc = yaml.safe_load(rc_path.read_text(encoding="utf-8")) if rc_path.is_file() else None
        model = ((rc or {}).get("config") or {}).get("model")
        if not isinstance(model, dict):
            raise CheckpointError(f"{rc_path}: no model section, so the architecture of {path} is unknown; pass the "
                                  f"run's release directory (RUN_DIR/final) instead")
        seq_len = ((rc or {}).get("config") or {}).get("data", {}).get("seq_len")
        tok = path.parent.parent / "tokenizer" / "tokenizer.json"
        return InitWeights(path, "training", ModelConfig.from_dict(model), ck["model_state"],
                           str(tok) if tok.is_file() else None, seq_len if isinstance(seq_len, int) else None, None,
                           rc)
    cfg, state = load_release(path)
    qc = read_quantization_config(path)
    run_path = path / "k3_run.yaml"
    info = yaml.safe_load(run_path.read_text(encoding="utf-8")) if run_path.is_file() else None
    tok = path / "tokenizer.json"
    return InitWeights(path, "release", cfg, state, str(tok) if tok.is_file() else None, trained_seq_len(path),
                       None if qc is None else str(qc.get("format")), info)


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, innermost first: what path.mkdir(parents=True) creates."""
    missing, p = [], path.absolute()
    while not p.exists():
        missing.append(p)
        p = p.parent
    return missing


def _remove_dirs(made: list[Path]) -> None:
    """Undo path.mkdir(parents=True): remove the run directory, then each parent it created while it is empty (a
    parent such as runs/ may meanwhile hold another run's directory)."""
    if made:
        shutil.rmtree(made[0], ignore_errors=True)
    for d in made[1:]:
        if any(d.iterdir()):
            break
        d.rmdir()


def fit_with_progress(trainer: Trainer, tcfg, console, *, resume: bool, header: str, command: str) -> Any:
    """With `resume`, the run's latest checkpoint first; then the `header` line and trainer.fit under pretrain's
    progress display: a redrawn bar on a terminal, one line per log step in logs and pipes. Returns the final
    LoopState (TrainingError printed, then raised); a run stopped by a signal prints how to continue (`command`)."""
    if resume:
        latest = trainer.ckpt.latest()
        if latest is None:
            raise CheckpointError(f"--resume: no complete checkpoint under {trainer.run_dir / 'checkpoints'}")
        trainer.resume_from(latest)
        console.print(f"[bold]resumed[/] from {latest} at step {trainer.state.step}")
    console.print(header)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                  TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False) as prog:
        task = prog.add_task("train", total=tcfg.max_steps, completed=trainer.state.step, loss="-", tps="-")
        t0, tok0, start_step = time.time(), trainer.state.tokens, trainer.state.step

        plain = not console.is_terminal  # logs and pipes get one line per log step instead of a redrawn bar

        def progress(step: int, loss: float) -> None:
            elapsed = max(time.time() - t0, 1e-9)
            tps = (trainer.state.tokens - tok0) / elapsed
            prog.update(task, completed=step, loss=f"{loss:.3f}", tps=f"{tps:,.0f}")
            if plain and (step % tcfg.log_every == 0 or step == tcfg.max_steps):
                done = step - start_step
                eta = elapsed / max(done, 1) * (tcfg.max_steps - step)
                console.print(f"step {step}/{tcfg.max_steps} loss {loss:.4f} {tps:,.0f} tok/s "
                              f"elapsed {elapsed:.0f}s eta {eta:.0f}s")

        try:
            state = trainer.fit(progress=progress)
        except TrainingError as e:
            # escaped: a collective's message can hold "[path/file.cc:129]", which rich would read as a tag
            console.print(f"[red]error:[/] {rich.markup.escape(str(e))}")
            raise
    if trainer.stopped_by_signal:
        console.print(f"stopped at step {state.step}; checkpoint {trainer.ckpt.latest()}. "
                      f"Continue with: {command} --resume --out {trainer.run_dir}")
    return state


def write_release(run_dir: Path, state_dict: dict, mcfg: ModelConfig, tok, run_info: dict, export_dtype: str,
                  seq_len: int | None, quantization_config: dict | None = None) -> Path:
    """RUN_DIR/final from trained weights: config.json, weights, tokenizer files, generation_config.json."""
    gen_cfg = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id,
               "temperature": 0.8, "top_p": 0.95, "max_new_tokens": 256, "do_sample": True}
    return save_release(run_dir / "final", state_dict, mcfg, quantization_config=quantization_config,
                        tokenizer_dir=run_dir / "tokenizer", run_info=run_info, generation_config=gen_cfg,
                        dtype=torch.float32 if export_dtype == "float32" else torch.bfloat16,
                        max_position_embeddings=seq_len)


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def run(cfg: Any, *, run_dir: Path, resume: bool = False, init: str | InitWeights | None = None,
        run_config: dict | None = None, console=None, init_may_differ: tuple[str, ...] = (),
        command: str = "k3 pretrain", prepare_model: Callable[[torch.nn.Module], None] | None = None,
        release_state: Callable[[torch.nn.Module], tuple[dict, dict | None]] | None = None) -> PretrainResult:
    """Pretrain a K3 model. `cfg` carries the sections model, data, optim, train, ckpt (a K3Config), and
    `parallel` when the command runs on several processes (torchrun / accelerate launch: docs/parallel.md).

    init: weights to start from (a release or training checkpoint path, or read_init's result); init_may_differ:
    the ModelConfig fields in which they may differ from cfg.model (extend-context's position mode and RoPE base);
    command: the command a stopped run's resume hint names.
    Hooks of recipes that train through this run (k3 quantize's QAT): prepare_model(model) changes the model in
    place after its initial weights, before the optimizer (fake quantization); release_state(model) returns the
    (state dict, quantization_config or None) final/ is written from instead of the model's own weights.
    """
    d = start_distributed(getattr(cfg, "parallel", None), cfg.train.device, command,
                          num_experts=cfg.model.num_experts, seq_len=cfg.data.seq_len)
    finished = False
    try:
        out = _run(cfg, d, run_dir=run_dir, resume=resume, init=init, run_config=run_config, console=console,
                   init_may_differ=init_may_differ, command=command, prepare_model=prepare_model,
                   release_state=release_state)
        finished = True
        return out
    except RuntimeError as e:  # a collective inside FSDP's forward or backward failed: a peer is gone
        if d is None or isinstance(e, PeerError) or not is_collective_failure(e):
            raise
        raise PeerError(lost_peer_message(d.rank, d.world_size, "a collective of the step", e, d.timeout_s)) from e
    finally:
        stop_distributed(d, finished)


def _run(cfg: Any, d: Distributed | None, *, run_dir: Path, resume: bool, init: str | InitWeights | None,
         run_config: dict | None, console, init_may_differ: tuple[str, ...], command: str,
         prepare_model: Callable[[torch.nn.Module], None] | None,
         release_state: Callable[[torch.nn.Module], tuple[dict, dict | None]] | None) -> PretrainResult:
    main = d is None or d.is_main  # the process that prints and writes the run directory's own files
    console = console or make_console()
    if not main:
        console = Console(quiet=True)
    mcfg, dcfg, ocfg, tcfg, ccfg = cfg.model, cfg.data, cfg.optim, cfg.train, cfg.ckpt
    run_dir = Path(run_dir)
    ckpt_root = run_dir / "checkpoints"
    has_ckpt = ckpt_root.is_dir() and any(p.name.startswith("step-") for p in ckpt_root.iterdir())
    if resume and not has_ckpt:
        raise CheckpointError(f"--resume: no training checkpoint under {ckpt_root}; start a new run without "
                              f"--resume, or point --out at the run directory to continue")
    if not resume and has_ckpt:
        raise ConfigError(f"{run_dir} already holds a run with checkpoints; pass --resume to continue it, or "
                          f"choose another --out")
    if tcfg.activation_checkpointing not in ("none", "mla", "all"):
        raise ConfigError(f"train.activation_checkpointing={tcfg.activation_checkpointing!r}: use none, mla (the MLA "
                          f"layers recomputed in the backward) or all (every layer)")
    if tcfg.loss_chunk_tokens < 0:
        raise ConfigError(f"train.loss_chunk_tokens={tcfg.loss_chunk_tokens} must be >= 0 (0 = the default chunk)")
    if d is not None:
        check_data_parallel(tcfg, dcfg, release_state is not None or prepare_model is not None)
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    device = resolve_device(tcfg.device) if d is None else d.device
    autocast = resolve_autocast(tcfg.dtype, device)
    check_cuda_graph(tcfg, device, data_parallel=d is not None, custom_loss=False)
    torch.manual_seed(tcfg.seed)

    # ---- initial weights (before data, so a bad --init fails fast)
    init_state = None
    if init is not None:
        weights = init if isinstance(init, InitWeights) else read_init(init)
        if weights.quantization is not None:
            raise CheckpointError(f"{weights.path}: a quantized release ({weights.quantization}) cannot be trained; "
                                  f"start from the bf16 / fp32 release it was made from")
        init_state = weights.state
        diff = _same_architecture(weights.cfg, mcfg, init_may_differ)
        if diff:
            raise ConfigError(f"--init {weights.path}: its architecture differs from the configured model in {diff}; "
                              f"pass the same model preset or --set model.<field>=<value> to match")

    # ---- data and tokenizer
    tok_src = dcfg.tokenizer
    if tok_src is None and init is not None and weights.tokenizer is not None:
        tok_src = weights.tokenizer  # continued training must keep the token ids
    if resume and tok_src is None and (run_dir / "tokenizer" / "tokenizer.json").is_file():
        tok_src = str(run_dir / "tokenizer" / "tokenizer.json")
    if tok_src != dcfg.tokenizer:
        import dataclasses
        dcfg = dataclasses.replace(dcfg, tokenizer=tok_src)
    data = (prepare_data(dcfg, mcfg.vocab_size, console=console) if d is None
            else d.main_first(lambda: prepare_data(dcfg, mcfg.vocab_size, console=console, show_progress=main)))
    if data.tokenizer.vocab_size > mcfg.vocab_size:
        raise ConfigError(f"tokenizer has {data.tokenizer.vocab_size} tokens but model.vocab_size is "
                          f"{mcfg.vocab_size}; raise model.vocab_size or use a smaller tokenizer")
    # nothing is written into the run directory before this point; a start that fails from here until
    # run_config.yaml is written removes what it made, so no empty or half-started run directory is left behind
    made = _missing_dirs(run_dir) if main else []
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
    try:
        if main:
            data.tokenizer.save(run_dir / "tokenizer")

        # ---- model, optimizer, loaders
        model = build_model(mcfg, seed=tcfg.seed, device="cpu")
        if init_state is not None:
            load_state_into(model, init_state)
        if prepare_model is not None:
            prepare_model(model)
        model.to(device)
        counts = count_parameters(model)  # before sharding: whole shapes
        if d is not None:
            shard_model(model, d.mesh, device)
        if tcfg.compile:
            model = torch.compile(model)  # type: ignore[assignment]
        optimizer = build_optimizer(model, ocfg, sharded_update=None if d is None else ShardedMuonUpdate(d))
        ranks = {} if d is None else {"rank": d.rank, "world": d.world_size}
        Loader = BatchLoader if d is None else RankBatchLoader
        train_loader = Loader(data.train, seq_len=dcfg.seq_len, batch_size=tcfg.batch_size, seed=dcfg.seed, **ranks)
        if dcfg.passkey_fraction > 0:
            train_loader = PasskeyMixLoader(train_loader, data.tokenizer, dcfg.passkey_fraction, seed=dcfg.seed)

        # built now, though first used at the first evaluation, so that a validation split shorter than one window
        # fails here and not after the training (val mode is stateless: each take() starts from the first window)
        val_loader = Loader(data.val, seq_len=dcfg.seq_len, batch_size=tcfg.batch_size, seed=dcfg.seed, mode="val",
                            **ranks)

        def val_batches():
            return val_loader.take(tcfg.eval_batches)

        rc = dict(run_config or {})
        rc["stats"] = {"n_params_total": counts["total"], "n_params_active": counts["active"],
                       "n_params_active_nonembed": counts["active_nonembed"],
                       "n_params_total_nonembed": counts["total_nonembed"], "n_params_mtp": counts["mtp"],
                       "train_tokens_available": int(data.train.n_tokens), "val_tokens": int(data.val.n_tokens),
                       "tokens_per_step": tcfg.batch_size * tcfg.grad_accum * dcfg.seq_len * (d.world_size if d else 1)}
        if main:
            _atomic_write_text(run_dir / "run_config.yaml", yaml.safe_dump(rc, sort_keys=False))
    except BaseException:
        _remove_dirs(made)
        raise
    # the lines of an earlier attempt in this directory that stopped before its first checkpoint
    if not resume and main:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)

    trainer = (Trainer if d is None else functools.partial(DistributedTrainer, dist=d))(
        model, optimizer, ocfg, tcfg, ccfg, run_dir, train_loader, val_batches,
        bytes_per_token=data.meta.get("val_bytes_per_token"), device=device, autocast_dtype=autocast,
        flops_per_token=training_flops_per_token(mcfg, counts, dcfg.seq_len),
        peak_flops=peak_flops_for(device, tcfg.peak_tflops))
    header = (f"[bold]{' '.join(command.split()[:2])}[/] {mcfg.name}: {describe_parameters(counts)}, "
              f"{data.train.n_tokens / 1e6:.2f}M train tokens, device {device}, run dir {run_dir}"
              + (f", {d.world_size} data-parallel ranks (FSDP2"
                 + (", the routed experts sharded over them)" if "ep" in (d.mesh.mesh_dim_names or ()) else ")")
                 if d is not None else ""))
    state = fit_with_progress(trainer, tcfg, console, resume=resume, header=header, command=command)

    if trainer.stopped_by_signal:
        return PretrainResult(run_dir, None, state.step, None, None, state.wall_time, state.tokens,
                              stop_signal=trainer.stop_signal)

    ev = trainer.evaluate()
    trainer._record_eval(ev)
    rc["stats"]["tokens"] = state.tokens
    rc["stats"]["steps"] = state.step
    rc["stats"]["final_val_loss"] = ev["val_loss"]
    rc["stats"]["final_val_bpb"] = ev.get("val_bpb")
    rc["stats"]["wall_time_s"] = state.wall_time
    if main:
        _atomic_write_text(run_dir / "run_config.yaml", yaml.safe_dump(rc, sort_keys=False))
    if d is not None:  # the whole weights gathered on rank 0: final/ is the one-file release of every run
        release_sd, qc = full_model_state(model), None
    else:
        release_sd, qc = ({k: v.detach().cpu() for k, v in model.state_dict().items()}, None) \
            if release_state is None else release_state(model)
    final = (write_release(run_dir, release_sd, mcfg, data.tokenizer, rc, ccfg.export_dtype, dcfg.seq_len, qc)
             if main else run_dir / "final")
    # the resumable checkpoint (weights + optimizer state, ~4x the release) after the release, so a run stopped while
    # writing it still has its final/ (on the H200, 2026-11-29, a k3-small run's time limit struck after the final
    # evaluation, most likely inside this write when it came first, and left no final/)
    trainer.save_checkpoint()
    bpb = ev.get("val_bpb")
    console.print(f"[bold green]done[/] step {state.step}: val_loss {ev['val_loss']:.4f}"
                  + (f", val_bpb {bpb:.4f}" if bpb is not None else "")
                  + f", {state.tokens / 1e6:.2f}M tokens in {state.wall_time:.0f}s; checkpoint: {final}")
    if not math.isfinite(ev["val_loss"]):
        raise TrainingError(f"final validation loss is not finite ({ev['val_loss']})")
    return PretrainResult(run_dir, Path(final), state.step, ev["val_loss"], bpb, state.wall_time, state.tokens)
