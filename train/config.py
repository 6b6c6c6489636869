"""Config sections owned by k3.train (standard library only; style.md section 4).

Each field carries a one-line comment; `k3 pretrain --set section.key=value` reaches every field.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where tokens come from and how they are packed."""

    source: str = "stdlib"  # "stdlib" (the interpreter's standard library .py files), a path/glob of .txt/.jsonl/.parquet, or "hf:NAME"
    hf_split: str = "train"  # split of a Hugging Face dataset (source "hf:NAME")
    hf_text_field: str = "text"  # text column of a Hugging Face dataset
    val_fraction: float = 0.05  # fraction of files (or documents) held out for validation, chosen deterministically
    tokenizer: str | None = None  # path of an existing tokenizer.json to reuse; None trains a byte-level BPE
    vocab_size: int | None = None  # BPE vocab size; None = the model's vocab_size
    tokenizer_sample_bytes: int = 20_000_000  # bytes of training text sampled to train the BPE
    max_bytes: int | None = None  # cap on total text bytes read (None = all)
    cache_dir: str = ".k3_cache"  # tokenized shard cache, keyed by data + tokenizer hash
    seq_len: int = 256  # tokens per training sequence
    seed: int = 1234  # seed of the data order


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """Muon + AdamW, QK-Clip, schedule (architecture.md sections 11-12)."""

    optimizer: str = "muon"  # "muon" (Muon for hidden matrices + AdamW for the rest) | "adamw" (AdamW everywhere)
    lr: float = 3e-3  # peak learning rate, shared by Muon (Moonlight-scaled) and AdamW
    min_lr_ratio: float = 0.1  # floor of the cosine as a fraction of lr
    schedule: str = "cosine"  # "cosine" | "wsd" | "constant"
    warmup_steps: int | None = None  # None = max(1% of steps, min(100, 10% of steps))
    wsd_decay_fraction: float = 0.2  # WSD: fraction of steps in the final decay
    weight_decay: float = 0.1  # decoupled weight decay (not applied to norms, biases, gates, pseudo-queries)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    momentum: float = 0.95  # Muon momentum (Nesterov)
    ns_steps: int = 5  # Newton-Schulz iterations
    per_head_muon: bool = True  # orthogonalize head-major attention matrices per head
    per_head_params: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "g_proj", "q_b_proj", "kv_b_proj"])  # module names treated per head
    qk_clip_tau: float | None = 100.0  # QK-Clip threshold on MLA max logits; None disables
    grad_clip: float = 1.0  # global grad-norm clip; 0 disables
    mtp_lambda: float = 0.3  # weight of the MTP loss for the first `mtp_lambda_switch` of training
    mtp_lambda_late: float = 0.1  # weight of the MTP loss afterwards
    mtp_lambda_switch: float = 0.7  # fraction of steps at which the MTP weight drops
    router_balance: str = "qb"  # "qb" (Quantile Balancing) | "loss_free" (DeepSeek sign rule) | "none"
    qb_method: str = "exact"  # "exact" (sort) | "histogram" (for accumulated / sharded batches)
    qb_bins: int = 512  # histogram bins for qb_method=histogram
    loss_free_gamma: float = 1e-3  # step of the loss-free bias rule


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The train loop."""

    max_steps: int = 1000  # optimizer steps
    batch_size: int = 16  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    eval_every: int = 100  # steps between evaluations (0 = only at the end)
    eval_batches: int = 8  # micro-batches per evaluation
    log_every: int = 10  # steps between metrics.jsonl lines
    seed: int = 0  # model init and dropout seed
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # "auto" (bf16 autocast on CUDA, fp32 on CPU) | "float32" | "bfloat16"
    compile: bool = False  # torch.compile the model
    threads: int | None = None  # torch CPU threads (None = torch default)
    track_max_logit: bool = True  # compute MLA per-head max logits each step (needed for QK-Clip and logging)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Training checkpoints under RUN_DIR/checkpoints/step-N/."""

    every: int = 200  # steps between training checkpoints (0 = only at the end / on signal)
    keep_last: int = 2  # training checkpoints kept
    export_dtype: str = "float32"  # dtype of the release model.safetensors ("float32" | "bfloat16")
