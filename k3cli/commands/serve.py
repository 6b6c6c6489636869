"""`k3 serve CKPT`: an OpenAI-compatible HTTP server for a release checkpoint.

Configuration: ServeConfig's defaults < `--preset` (k3cli/presets/serve/) < `--config FILE` < the flag shortcuts
below < `--set serve.KEY=VALUE` / `--set kernels.KEY=VALUE`; the kernel settings are applied once here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from k3.cli.errors import friendly_errors

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@friendly_errors
def serve(
    ckpt: Path = typer.Argument(..., help="release checkpoint directory (e.g. runs/<name>/final)"),
    preset: str = typer.Option("default", "--preset", "-p", help="serve preset: default (safe anywhere), "
                               "gpu-throughput (32 streams, compiled CUDA graphs: minutes of startup)"),
    config: list[Path] | None = typer.Option(None, "--config", "-c", help="YAML file of sections (serve:, kernels:) "
                                             "merged over the preset; repeatable"),
    set_: list[str] | None = typer.Option(None, "--set", "-s", help="override one field, e.g. --set "
                                          "serve.max_queue=64 --set kernels.backend=torch; repeatable, applied last"),
    host: str | None = typer.Option(None, "--host", help="bind address (default 127.0.0.1; 0.0.0.0 exposes the "
                                    "server) [serve.host]"),
    port: int | None = typer.Option(None, "--port", min=1, max=65535, help="TCP port (default 8000) [serve.port]"),
    api_key: list[str] | None = typer.Option(None, "--api-key", help="accepted Bearer key (repeatable; or "
                                             "K3_API_KEY) [serve.api_keys]"),
    max_batch: int | None = typer.Option(None, "--max-batch", min=1, help="running sequences at once (default 16) "
                                         "[serve.max_num_seqs]"),
    max_model_len: int | None = typer.Option(None, "--max-model-len", min=2, help="context limit, prompt + output "
                                             "(default 2048) [serve.max_model_len]"),
    max_num_batched_tokens: int | None = typer.Option(None, "--max-num-batched-tokens", min=0,
                                                      help="tokens per engine step (prefill chunk budget); 0 = 256 "
                                                           "on a CPU, 2048 on a GPU [serve.max_num_batched_tokens]"),
    max_queue: int | None = typer.Option(None, "--max-queue", min=1, help="waiting requests before 503 queue_full "
                                         "(default 512) [serve.max_queue]"),
    max_concurrent_per_key: int | None = typer.Option(None, "--max-concurrent-per-key", min=0,
                                                      help="generation requests in flight per API key before 429 "
                                                           "(0 = no limit) [serve.max_concurrent_per_key]"),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="model id (default: the "
                                                 "directory name) [serve.served_model_name]"),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="disable prefix caching "
                                           "[serve.enable_prefix_caching=false]"),
    device: str | None = typer.Option(None, "--device", help="auto | cpu | cuda | cuda:N [serve.device]"),
    dtype: str | None = typer.Option(None, "--dtype", help="auto | float32 | bfloat16 | float16; auto = bfloat16 "
                                     "on a GPU (float16 for a float16 checkpoint), float32 on the CPU [serve.dtype]"),
    speculative_tokens: int | None = typer.Option(None, "--speculative-tokens", min=0, max=16,
                                                  help="MTP draft tokens per step (0 = off) "
                                                       "[serve.num_speculative_tokens]"),
    cuda_graphs: bool | None = typer.Option(None, "--cuda-graphs/--no-cuda-graphs",
                                            help="on CUDA, replay decode, prefill-chunk, verify and MTP draft steps "
                                                 "from CUDA graphs (default on) [serve.cuda_graphs]"),
    cpu_small_step_threads: int | None = typer.Option(None, "--cpu-small-step-threads", min=0,
                                                      help="CPU only: intra-op threads for steps of <= 64 tokens; "
                                                           "0 = torch's default [serve.cpu_small_step_threads]"),
    log_level: str | None = typer.Option(None, "--log-level", help=f"uvicorn's log level ({', '.join(LOG_LEVELS)}; "
                                         "default warning); k3's startup lines show unless error or critical "
                                         "[serve.log_level]"),
    cuda_graph_batches: str | None = typer.Option(None, "--cuda-graph-batches", help="batch sizes whose CUDA graphs "
                                                  "the warm-up captures (and with --compile-decode compiles), "
                                                  "comma-separated (default 1,8,32) [serve.cuda_graph_batches]"),
    compile_decode: bool | None = typer.Option(None, "--compile-decode/--no-compile-decode",
                                               help="torch.compile each warmed decode and verify shape before its "
                                                    "capture: fused kernels for 1-2 min of startup per shape "
                                                    "[serve.compile_decode]"),
) -> None:
    """Serve CKPT over HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize.

    Every setting is a field of the `serve:` section (k3cli/README.md); the flags are shortcuts for the common ones.
    """
    from k3.cli.config import apply_kernels, resolve_config, resolve_device
    from k3.serve.server import run_server

    graph_batches = None
    if cuda_graph_batches is not None:
        try:
            graph_batches = [int(b) for b in cuda_graph_batches.split(",") if b.strip()]
            if not graph_batches or any(b < 1 for b in graph_batches):
                raise ValueError
        except ValueError:
            raise typer.BadParameter(f"expected comma-separated positive batch sizes such as 1,8,32, got "
                                     f"{cuda_graph_batches!r}", param_hint="--cuda-graph-batches") from None
    if log_level is not None and log_level.lower() not in LOG_LEVELS:
        raise typer.BadParameter(f"unknown log level {log_level!r}; use {', '.join(LOG_LEVELS)}",
                                 param_hint="--log-level")
    keys = list(api_key or []) or ([os.environ["K3_API_KEY"]] if os.environ.get("K3_API_KEY") else None)
    shortcuts = {"host": host, "port": port, "api_keys": keys, "max_num_seqs": max_batch,
                 "max_model_len": max_model_len, "max_num_batched_tokens": max_num_batched_tokens,
                 "max_queue": max_queue, "max_concurrent_per_key": max_concurrent_per_key,
                 "served_model_name": served_model_name, "enable_prefix_caching": False if no_prefix_caching else None,
                 "device": device, "dtype": dtype, "num_speculative_tokens": speculative_tokens,
                 "cuda_graphs": cuda_graphs, "cpu_small_step_threads": cpu_small_step_threads,
                 "log_level": None if log_level is None else log_level.lower(), "cuda_graph_batches": graph_batches,
                 "compile_decode": compile_decode}
    over = {"serve": {"ckpt": str(ckpt), **{k: v for k, v in shortcuts.items() if v is not None}}}
    cfg = resolve_config("serve", preset=preset, config_files=[str(p) for p in config or []], sets=list(set_ or []),
                         overrides=over)
    resolve_device(cfg.serve.device, "serve.device")  # a device this torch cannot use: one line, before any loading
    kernels = apply_kernels(cfg)
    env = kernels["env_overrides"]
    env_note = f" ({', '.join(f'{k}={v}' for k, v in env.items())} from the environment)" if env else ""
    print(f"k3 serve: kernels {kernels['effective']}{env_note}", file=sys.stderr, flush=True)
    run_server(cfg.serve)
