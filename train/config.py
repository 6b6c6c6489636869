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
    passkey_fraction: float = 0.0  # training sequences replaced by synthetic passkey documents (k3.train.passkey); k3 extend-context's presets set 0.1


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
    cuda_graph: bool = False  # one CUDA graph per micro-step (forward, loss, backward), replayed from the second step of a shape: the host's launches leave the step (k3.train.graphs; one GPU, the next-token loss)
    threads: int | None = None  # torch CPU threads (None = torch default)
    track_max_logit: bool = True  # compute MLA per-head max logits each step (needed for QK-Clip and logging)
    peak_tflops: float | None = None  # device peak for the logged `mfu`; None: 989 (bf16 datasheet) on H100/H200, else no mfu
    activation_checkpointing: str = "none"  # "none" | "mla" (the MLA layers' mixer and MLP recomputed in the backward) | "all" (every layer's); memory for long sequences
    loss_chunk_tokens: int = 0  # tokens per chunk of the LM head + cross-entropy, so the [B, T, V] logits never exist at once: the fused loss (its gradients formed per chunk) for a plain head, the head recomputed in the backward for another (a QAT head); 0 = the fused loss's default chunk (k3.kernels.loss.default_chunk_tokens), the whole logits for another head


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Training checkpoints under RUN_DIR/checkpoints/step-N/."""

    every: int = 200  # steps between training checkpoints (0 = only at the end / on signal)
    keep_last: int = 2  # training checkpoints kept
    export_dtype: str = "float32"  # dtype of the release model.safetensors ("float32" | "bfloat16")


@dataclass(kw_only=True, slots=True)
class ScalingConfig:
    """`k3 scaling-fit`: Chinchilla approach-3 fit of L(N, D) = E + A/N^alpha + B/D^beta (k3.train.scaling)."""

    inputs: list[str] = field(default_factory=list)  # CSV files (N, D, loss[, C] columns) and/or k3 run directories
    out: str = "scaling_fit"  # output directory for fit.json and fit.png
    budgets: list[float] = field(default_factory=list)  # compute budgets C in FLOPs to plan for (C = 6 N D)
    bootstrap: int = 0  # bootstrap resamples of the points for percentile intervals (0 = no intervals)
    bootstrap_starts: int = 32  # starts per bootstrap refit: the lowest distinct optima of the full fit, refined
    ci: float = 0.95  # central coverage of the bootstrap percentile intervals
    seed: int = 0  # seed of the bootstrap resampling
    params: str = "active"  # N of run directories: "active" or "total" non-embedding parameters
    exclude: list[str] = field(default_factory=list)  # filter expressions on N, D, C, loss; matching points are dropped
    huber_delta: float = 1e-3  # Huber delta on the log-loss residual (Hoffmann et al. 2022)
    grid_alpha: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0, 1.5, 2.0])  # alpha values of the start grid
    grid_beta: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0, 1.5, 2.0])  # beta values of the start grid
    grid_e: list[float] = field(default_factory=lambda: [-1.0, -0.5, 0.0, 0.5, 1.0])  # e = log E start values
    grid_a: list[float] = field(default_factory=lambda: [0.0, 5.0, 10.0, 15.0, 20.0, 25.0])  # a = log A start values
    grid_b: list[float] = field(default_factory=lambda: [0.0, 5.0, 10.0, 15.0, 20.0, 25.0])  # b = log B start values
    max_iter: int = 1000  # L-BFGS iterations per start; a start still running then counts as not converged
    ftol: float = 2.220446049250313e-09  # stop when the relative objective decrease is below this (scipy's factr*eps)
    gtol: float = 1e-5  # stop when the largest gradient component is below this (scipy's pgtol)
    memory: int = 10  # L-BFGS history pairs (scipy's maxcor)
    polish: int = 8  # best distinct grid optima refined to a stationary point (0 = report the grid's best as is)
    threads: int | None = 1  # torch CPU threads for the fit (None = torch default); 2 gain ~1.25x, lose on a busy CPU
    plot: bool = True  # write fit.png


@dataclass(kw_only=True, slots=True)
class QuantizeConfig:
    """`k3 quantize`: format, modules, mode and the calibration search (k3.train.quantize; model/README.md)."""

    method: str = "w4a8"  # "w4a8" (int4 weights, per-token FP8 activations) | "w4a16" (int4, activations as computed) | "w8a16" (int8 per output channel)
    group_size: int = 32  # int4 group along the in-features: 16 | 32 | 64 | 128 (unused by the per-channel w8a16)
    mode: str = "ptq"  # "ptq" (round-to-nearest, calibrated clipping with `data`) | "qat" (fake-quant fine-tune on `data`, then convert)
    modules: str = "routed_experts"  # "routed_experts" | "experts" (+ shared experts) | "all_linear" (+ attention, dense MLP, MTP, head)
    data: str | None = None  # text for calibration (ptq) or fine-tuning (qat), any data.source value; None: ptq without calibration
    calib_batches: int = 8  # ptq, and qat's calibrated scale_init: calibration batches of train.batch_size x data.seq_len tokens from the train split of `data`
    clip_grid: int = 20  # calibration: clip ratios searched are 1 - i / clip_grid, i = 0 .. clip_grid * clip_max_shrink (AWQ's grid)
    clip_max_shrink: float = 0.5  # calibration: the smallest clip ratio searched is 1 - clip_max_shrink
    scales: str = "learned"  # qat: the fake quantizer's int4 scales: "learned" (trained per-group parameters, LSQ; w8a16 stays absmax) | "absmax" (the weights' absmax / 7, recomputed every step)
    scale_init: str = "calibrated"  # qat, scales learned: start from "calibrated" (ptq's clip search on calib_batches of `data`) | "rtn" (absmax / 7)
    scale_lr: float = 0.03  # qat, scales learned: their learning rate as a multiple of optim.lr (AdamW, no weight decay)


@dataclass(kw_only=True, slots=True)
class DistillConfig:
    """`k3 distill`: on-policy distillation of a student from routed teachers (k3.train.distill)."""

    loss: str = "reverse_kl"  # "reverse_kl" (full vocabulary) | "sampled_reverse_kl" (sampled-token log-ratio as advantage) | "forward_kl" | "jsd"
    beta: float = 0.5  # jsd: the mixture weight of the teacher (0 = forward KL, 1 = reverse KL, GKD's beta)
    lmbda: float = 0.0  # fraction of steps whose completions the teachers generate instead of the student
    temperature: float = 1.0  # sampling temperature of the completions (0 = greedy)
    top_p: float = 1.0  # nucleus mass of the completions' sampling
    max_new_tokens: int = 64  # completion tokens generated per prompt at most (EOS ends one earlier)
    routing: str = "named"  # prompts without `teacher`: "named" (to default_teacher) | "uniform" (a random teacher) | "all" (the teachers' mean log-probabilities)
    default_teacher: str | None = None  # routing named: the teacher of prompts without one (None: the only teacher)
    max_num_seqs: int = 64  # completions decoded together in the batched generation


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Process layout under torchrun / accelerate launch: dp x ep x cp ranks (docs/parallel.md)."""

    dp: int = 1  # data-parallel ranks: each trains on its own batches, parameters and optimizer state sharded (FSDP2)
    ep: int = 1  # expert-parallel ranks: each owns num_experts / ep routed experts, tokens reach them by all-to-all in the latent width
    cp: int = 1  # context-parallel ranks: each holds seq_len / cp tokens of every sequence
    redundant_experts: int = 0  # R: expert slots per EP rank filled each step with copies of other ranks' experts, planned from the last step's router counts (k3.train.parallel.planner); 0 = static placement
    timeout_s: float = 600.0  # seconds a rank waits in a collective for its peers before every rank stops with an error (torchtitan's and NCCL's 10 min)

    def validate(self, *, world_size: int | None = None, num_experts: int | None = None,
                 seq_len: int | None = None) -> ParallelConfig:
        """self, or ValueError naming the sizes and the fix. world_size (the launcher's WORLD_SIZE), num_experts
        (model.num_experts) and seq_len (data.seq_len) are checked when given.
        Example: ParallelConfig(dp=2, ep=2).validate(world_size=4, num_experts=8)."""
        for name in ("dp", "ep", "cp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel.{name} must be an integer >= 1, got {v!r}")
        r = self.redundant_experts
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"parallel.redundant_experts must be an integer >= 0, got {r!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"parallel.timeout_s must be a number of seconds > 0, got {t!r}")
        if r and self.ep == 1:
            raise ValueError(f"parallel.redundant_experts={r} needs expert parallelism: set parallel.ep > 1 "
                             f"(with one EP rank every expert is already local)")
        size = self.dp * self.ep * self.cp
        if world_size is not None and size != world_size:
            raise ValueError(f"parallel.dp x parallel.ep x parallel.cp = {self.dp} x {self.ep} x {self.cp} = {size}, "
                             f"but the world size is {world_size}; launch {size} processes (torchrun --nproc_per_node "
                             f"{size}) or change the sizes so that their product is {world_size}")
        if num_experts is not None:
            if num_experts % self.ep:
                raise ValueError(f"parallel.ep={self.ep} must divide model.num_experts={num_experts} (each EP rank "
                                 f"owns num_experts / ep experts)")
            per_rank = num_experts // self.ep
            if per_rank + r > num_experts:
                raise ValueError(f"parallel.redundant_experts={r} is more than the {num_experts - per_rank} experts "
                                 f"each rank does not own (model.num_experts={num_experts}, parallel.ep={self.ep}); "
                                 f"use at most {num_experts - per_rank}")
        if seq_len is not None and seq_len % self.cp:
            raise ValueError(f"parallel.cp={self.cp} must divide data.seq_len={seq_len} (each CP rank holds "
                             f"seq_len / cp tokens of every sequence)")
        return self
