"""ServeConfig: every knob of `k3 serve` and the in-process engine (serving.md section 5, "Config").

Stdlib only, so the CLI can build it without importing torch or FastAPI.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SERVE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    ckpt: str = ""  # release checkpoint directory (config.json, model.safetensors, tokenizer.json)
    host: str = "127.0.0.1"  # bind address; loopback by default, exposing needs an explicit 0.0.0.0
    port: int = 8000  # TCP port
    api_keys: list[str] = field(default_factory=list)  # accepted Bearer keys; empty = no auth
    max_concurrent_per_key: int = 0  # in-flight generation requests per API key (0 = no limit); beyond it 429
    served_model_name: str = ""  # model id in /v1/models and requests; "" = the checkpoint directory's name
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on a GPU, float16 for a float16 checkpoint; float32 on a CPU) | float32 |
    #                      bfloat16 | float16
    max_model_len: int = 0  # context limit (prompt + output); 0 = 2048
    max_num_seqs: int = 16  # running sequences at once (KDA state slots)
    max_num_batched_tokens: int = 0  # token budget per engine step (decodes + prefill chunks); 0 = 256 on a CPU, 2048
    #                                  on a GPU (fewer, larger prefill steps where a step's cost is mostly launches)
    max_queue: int = 512  # waiting requests beyond which new ones get 503 queue_full
    kv_block_size: int = 64  # MLA latent tokens per page; a multiple of the KDA chunk (64)
    num_kv_blocks: int = 0  # latent pages in the pool; 0 = enough for max_num_seqs full contexts + prefix reuse
    enable_prefix_caching: bool = True  # share latent pages and restore KDA snapshots for repeated prefixes
    num_state_snapshots: int = 256  # KDA snapshot store entries (one per cached 64-token block boundary)
    num_speculative_tokens: int = 0  # MTP draft tokens per step (0 = off; needs a checkpoint with an MTP head)
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413
    max_n: int = 8  # largest accepted `n`
    max_top_logprobs: int = 20  # largest accepted top_logprobs / logprobs
    max_stop: int = 4  # most stop strings per request (OpenAI's limit)
    request_timeout_s: float = 600.0  # wall-clock limit of one request; it is aborted after that
    sse_ping_interval_s: float = 15.0  # SSE comment keep-alive while a request waits or prefills
    shutdown_timeout_s: float = 30.0  # on SIGTERM: 503 "draining" for new requests, in-flight ones get this long
    warmup: bool = True  # run every step shape once before /health reports ready
    cuda_graphs: bool = True  # on CUDA, replay decode, prefill-chunk, speculative verify and MTP draft steps from
    #                           CUDA graphs (k3.serve.graphs)
    cpu_small_step_threads: int = 1  # on a CPU, torch intra-op threads for steps of <= 64 tokens (decode, verify):
    #                                  waking more threads cost more than they saved on 2 cores with k3-tiny; 0 = torch's
    #                                  default (large models on many cores may want it)
    cuda_graph_batches: list[int] = field(default_factory=lambda: [1, 8, 32])  # batch sizes whose graphs the warm-up
    #                           captures (bucketed to powers of two, capped at max_num_seqs; each verify/MTP shape too
    #                           with speculation), and compiles with compile_decode; uncompiled, every power-of-two
    #                           bucket up to the largest is captured too, as are the 64-token prefill chunks; compiled,
    #                           a step runs on the smallest compiled bucket that holds it; other shapes: on first use
    compile_decode: bool = False  # torch.compile each warmed decode (and verify) shape before its capture (fused
    #                               kernels: k3-small decode at batch 1 went 7.1 -> 2.5 ms/step on an H200,
    #                               2026-11-29), at the cost of one to two minutes of compilation per shape at
    #                               startup (prefill-chunk and MTP draft graphs stay uncompiled), so off by default
    log_level: str = "warning"  # uvicorn log level

    def __post_init__(self) -> None:
        if self.dtype not in SERVE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(SERVE_DTYPES)}, got {self.dtype!r}")
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        bad = [b for b in self.cuda_graph_batches if not isinstance(b, int) or isinstance(b, bool) or b < 1]
        if bad:
            raise ValueError(f"cuda_graph_batches must be positive batch sizes, got {bad} in "
                             f"{self.cuda_graph_batches}; e.g. [1, 8, 32]")


def serve_dtype(requested: str, device: str, ckpt: str) -> str:
    """The dtype `k3 serve` holds the weights in: an explicit --dtype as given; "auto" = float32 on the CPU (bf16
    matmuls are slow there) and bfloat16 on a GPU (serving.md 2.5, "Weights: bf16 by default"; vLLM's "auto" also
    serves float32 checkpoints in half precision), except that a float16 checkpoint stays float16. The checkpoint's
    dtype is config.json's torch_dtype (float32 when absent). Example: serve_dtype("auto", "cuda", d) -> "bfloat16"
    for a float32 release d."""
    if requested != "auto":
        return requested
    if device == "cpu":
        return "float32"
    try:
        saved = json.loads((Path(ckpt) / "config.json").read_text()).get("torch_dtype", "float32")
    except (OSError, ValueError):
        saved = "float32"  # load_model reports a missing or corrupt config.json with its own message
    return "float16" if saved == "float16" else "bfloat16"
