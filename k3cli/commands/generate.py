"""`k3 generate CKPT --prompt TEXT`: stream a completion from a release checkpoint to the terminal."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from k3.cli.errors import friendly_errors


@friendly_errors
def generate(
    ckpt: Path = typer.Argument(..., help="release checkpoint directory (e.g. runs/<name>/final)"),
    prompt: str = typer.Option(..., "--prompt", help="text to continue"),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1,
                                   help="new tokens to generate at most. Where the prompt and these run past the "
                                        "sequence length the checkpoint was trained on (data.seq_len in its "
                                        "k3_run.yaml), k3 generate warns in one line on stderr and goes on"),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0, help="0 = greedy"),
    top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0, help="nucleus sampling mass"),
    top_k: int = typer.Option(0, "--top-k", min=0, help="keep the k most likely tokens (0 = off)"),
    seed: int | None = typer.Option(None, "--seed", help="sampling seed for reproducible output"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N; auto = cuda when a GPU is "
                               "usable"),
    dtype: str = typer.Option("auto", "--dtype", help="auto | float32 | bfloat16 | float16; auto = bfloat16 on a "
                              "GPU (float16 for a float16 checkpoint), float32 on the CPU, as k3 serve"),
    set_: list[str] | None = typer.Option(None, "--set", "-s", help="a kernel setting, e.g. --set "
                                          "kernels.backend=torch; repeatable"),
) -> None:
    """Generate text: one prefill of the prompt, then one decode step per new token (the serving engine; on a GPU
    each decode step replays a CUDA graph)."""
    from k3.cli.config import apply_kernels, resolve_config, resolve_device
    from k3.model.checkpoint import load_model, trained_seq_len
    from k3.model.tokenizer import K3Tokenizer
    from k3.serve.config import SERVE_DTYPES, serve_dtype
    from k3.serve.generate import stream_text

    if dtype not in SERVE_DTYPES:
        raise typer.BadParameter(f"unknown dtype {dtype!r}; use {', '.join(SERVE_DTYPES)}", param_hint="--dtype")
    apply_kernels(resolve_config("generate", preset=None, sets=list(set_ or []), sections=("kernels",)))
    dev = resolve_device(device, "--device")
    model, _ = load_model(ckpt, device=dev, dtype=serve_dtype(dtype, dev, str(ckpt)))
    tok = K3Tokenizer.from_file(ckpt)
    ids = tok.encode(prompt, add_bos=True)
    # a warning, not a stop: nothing in the model is sized by the trained length (KDA is a recurrence, MLA's RoPE is
    # computed for any position), so the text past it degrades rather than fails; k3 serve's max_model_len (2048 by
    # default) sizes its cache per sequence, it is not the model's limit
    trained = trained_seq_len(ckpt)
    if trained is not None and len(ids) + max_tokens > trained:
        print(f"warning: the prompt ({len(ids)} tokens) and --max-tokens {max_tokens} run past the {trained} tokens "
              f"this checkpoint was trained on (data.seq_len in {ckpt / 'k3_run.yaml'}); text beyond them is likely "
              f"degraded: use --max-tokens {max(trained - len(ids), 1)} for the trained length", file=sys.stderr)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    t0, n = time.time(), 0
    for ev in stream_text(model, tok, ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          seed=seed):
        if ev.error:
            raise RuntimeError(f"generation failed: {ev.error}")
        n += len(ev.token_ids)
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    dt = time.time() - t0
    print(f"[{n} tokens in {dt:.2f}s, {n / max(dt, 1e-9):.1f} tok/s]", file=sys.stderr)
