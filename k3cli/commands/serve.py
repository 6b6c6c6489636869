"""`k3 serve CKPT`: an OpenAI-compatible HTTP server for a release checkpoint (serving.md; issue 5)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from k3.cli.errors import friendly_errors


@friendly_errors
def serve(
    ckpt: Path = typer.Argument(..., help="release checkpoint directory (e.g. runs/<name>/final)"),
    host: str = typer.Option("127.0.0.1", "--host", help="bind address (0.0.0.0 exposes the server)"),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="TCP port"),
    api_key: list[str] | None = typer.Option(None, "--api-key", help="accepted Bearer key (repeatable; or "
                                                "K3_API_KEY)"),
    max_batch: int = typer.Option(16, "--max-batch", min=1, help="running sequences at once"),
    max_model_len: int = typer.Option(2048, "--max-model-len", min=2, help="context limit (prompt + output)"),
    max_num_batched_tokens: int = typer.Option(0, "--max-num-batched-tokens", min=0,
                                               help="tokens per engine step (prefill chunk budget); 0 = 256 on a "
                                                    "CPU, 2048 on a GPU"),
    max_queue: int = typer.Option(512, "--max-queue", min=1, help="waiting requests before 503 queue_full"),
    max_concurrent_per_key: int = typer.Option(0, "--max-concurrent-per-key", min=0,
                                               help="generation requests in flight per API key before 429 (0 = no "
                                                    "limit)"),
    served_model_name: str = typer.Option("", "--served-model-name", help="model id (default: directory name)"),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="disable prefix caching"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", "--dtype", help="auto | float32 | bfloat16 | float16; auto = bfloat16 on a "
                              "GPU (float16 for a float16 checkpoint), float32 on the CPU"),
    speculative_tokens: int = typer.Option(0, "--speculative-tokens", min=0, max=16,
                                           help="MTP draft tokens per step for greedy requests (0 = off)"),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs",
                                     help="on CUDA, replay decode, speculative verify and MTP draft steps from CUDA "
                                          "graphs (captured per batch bucket)"),
    cpu_small_step_threads: int = typer.Option(1, "--cpu-small-step-threads", min=0,
                                               help="CPU only: intra-op threads for steps of <= 64 tokens (decode); "
                                                    "0 = torch's default (try it for large models on many cores)"),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn's log level (critical, error, warning, "
                                  "info, debug, trace); k3's startup progress lines show unless error or critical"),
    cuda_graph_batches: str = typer.Option("1,8,32", "--cuda-graph-batches", help="batch sizes whose CUDA graphs are "
                                           "captured (and with --compile-decode compiled) before the server reports "
                                           "ready, comma-separated; without compile every power-of-two size up to "
                                           "the largest is captured too; with it, other sizes run padded to the "
                                           "next compiled one"),
    compile_decode: bool = typer.Option(False, "--compile-decode", help="torch.compile each graph-captured step "
                                        "before capturing it: fused kernels (k3-small batch-1 decode 7.1 -> 2.5 ms "
                                        "on an H200) for 1-2 min of compilation per captured shape at startup"),
) -> None:
    """Serve CKPT over HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    from k3.serve.config import ServeConfig
    from k3.serve.server import run_server

    try:
        graph_batches = [int(b) for b in cuda_graph_batches.split(",") if b.strip()]
        if any(b < 1 for b in graph_batches):
            raise ValueError
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated positive batch sizes such as 1,8,32, got "
                                 f"{cuda_graph_batches!r}", param_hint="--cuda-graph-batches") from None
    if log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
        raise typer.BadParameter(f"unknown log level {log_level!r}; use critical, error, warning, info, debug or "
                                 "trace", param_hint="--log-level")
    keys = list(api_key or [])
    if not keys and os.environ.get("K3_API_KEY"):
        keys = [os.environ["K3_API_KEY"]]
    try:  # ServeConfig checks --dtype and --device: a bad value is a usage error before anything loads
        cfg = ServeConfig(ckpt=str(ckpt), host=host, port=port, api_keys=keys, max_num_seqs=max_batch,
                          max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                          max_queue=max_queue, max_concurrent_per_key=max_concurrent_per_key,
                          served_model_name=served_model_name,
                          enable_prefix_caching=not no_prefix_caching, device=device, dtype=dtype,
                          num_speculative_tokens=speculative_tokens, cuda_graphs=cuda_graphs,
                          compile_decode=compile_decode, cpu_small_step_threads=cpu_small_step_threads,
                          cuda_graph_batches=graph_batches, log_level=log_level)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    run_server(cfg)
