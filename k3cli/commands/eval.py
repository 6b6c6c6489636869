"""`k3 eval passkey`, `k3 eval loss` and `k3 eval lm`: parse flags -> k3.train.evaluate.run_passkey / run_loss,
k3.serve.lm_eval.run_lm_eval."""

from __future__ import annotations

from pathlib import Path

import typer

from k3.cli.errors import friendly_errors

app = typer.Typer(name="eval", no_args_is_help=True, add_completion=False,
                  help="Evaluate a checkpoint: passkey retrieval by length and depth, loss by position, "
                       "lm-evaluation-harness tasks.")


def _numbers(text: str, kind, flag: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected comma-separated numbers, e.g. 256,512,1024",
                                 param_hint=flag) from None
    if not values:
        raise typer.BadParameter("give at least one value", param_hint=flag)
    return values


@app.command("passkey")
@friendly_errors
def passkey(
    ckpt: Path = typer.Argument(..., help="release checkpoint directory (e.g. runs/<name>/final); quantized ones too"),
    lengths: str = typer.Option("256,512,1024,2048,4096", "--lengths", help="prompt lengths in tokens, "
                                "comma-separated (each prompt is exactly this long)"),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", "--depths", help="where the key sits in the filler, as "
                               "fractions: 0 = first, 1 = just before the question"),
    trials: int = typer.Option(10, "--trials", min=1, help="prompts (random keys and filler) per length and depth"),
    seed: int = typer.Option(0, "--seed", help="seed of keys and filler windows: the same seed, the same prompts"),
    out: Path | None = typer.Option(None, "--out", "-o", help="where passkey.json and passkey.png go "
                                    "(default CKPT/../eval)"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N"),
) -> None:
    """Passkey retrieval: filler text from the model's own domain (the validation split of the data it was
    trained on), a random 5-digit key at each depth, "# What is the pass key? The pass key is" at the end, a
    greedy completion through the inference path (prefill + recurrent decode), exact match. Prints accuracy by
    length x depth; writes passkey.json (every trial) and passkey.png (heat map).

    Example: k3 eval passkey runs/tiny/final --lengths 256,1024,4096 --trials 5
    """
    from k3.cli.config import resolve_device
    from k3.serve.generate import generate_batch
    from k3.train.evaluate import run_passkey

    run_passkey(ckpt, lengths=_numbers(lengths, int, "--lengths"), depths=_numbers(depths, float, "--depths"),
                trials=trials, seed=seed, out=out or ckpt.parent / "eval", generate_batch=generate_batch,
                device=resolve_device(device, "--device"))


@app.command("loss")
@friendly_errors
def loss(
    ckpt: Path = typer.Argument(..., help="release checkpoint directory; every release k3 writes, quantized too"),
    data: str | None = typer.Option(None, "--data", help="text source (as data.source: stdlib, a path or glob, "
                                    "hf:NAME); default: the one the checkpoint was trained on; its validation split"),
    seq_len: int | None = typer.Option(None, "--seq-len", help="window length; default: the trained length"),
    batches: int = typer.Option(8, "--batches", min=1, help="batches of 16K tokens (16384 // seq-len windows, at "
                                "least one)"),
    out: Path | None = typer.Option(None, "--out", "-o", help="where loss.json and loss.png go (default "
                                    "CKPT/../eval)"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N"),
) -> None:
    """Validation loss, bits per byte, and loss by position bucket ([0, 1), [1, 2), [2, 4), ... up to --seq-len):
    whether later tokens use the earlier context. The buckets' token-weighted mean is the overall loss. Writes
    loss.json and loss.png.

    Example: k3 eval loss runs/tiny/final --seq-len 1024
    """
    from k3.cli.config import resolve_device
    from k3.train.evaluate import run_loss

    run_loss(ckpt, source=data, seq_len=seq_len, batches=batches, out=out or ckpt.parent / "eval",
             device=resolve_device(device, "--device"))


@app.command("lm")
@friendly_errors
def lm(
    ckpt: Path = typer.Argument(..., help="release checkpoint directory (e.g. runs/<name>/final); quantized ones too"),
    tasks: str = typer.Option(..., "--tasks", "-t", help="lm-eval task, group or tag names, comma-separated"),
    include_path: Path | None = typer.Option(None, "--include-path", help="folder of local task YAML files (their "
                                             "relative data_files are read from the working directory)"),
    limit: float | None = typer.Option(None, "--limit", min=0, help="documents per task (a fraction if < 1); "
                                       "for quick checks, not for reported numbers"),
    num_fewshot: int | None = typer.Option(None, "--num-fewshot", min=0, help="few-shot examples per prompt "
                                           "(default: the task's own)"),
    batch_size: int = typer.Option(1, "--batch-size", min=1, help="prompts per /v1/completions request"),
    device: str = typer.Option("auto", "--device", help="the server's device: auto | cpu | cuda | cuda:N"),
    dtype: str = typer.Option("auto", "--dtype", help="the server's dtype: auto | float32 | bfloat16 | float16"),
    port: int = typer.Option(0, "--port", min=0, max=65535, help="the server's loopback port (0 = a free one)"),
    max_model_len: int = typer.Option(2048, "--max-model-len", min=2, help="context limit of the server and of "
                                      "lm-eval (longer prompts are left-truncated by lm-eval)"),
    output: Path | None = typer.Option(None, "--output", "-o", help="write lm-eval's results as JSON here"),
    log_samples: bool = typer.Option(False, "--log-samples", help="include every document's requests and "
                                     "responses in --output"),
    seed: int = typer.Option(0, "--seed", help="lm-eval's random, numpy, torch and few-shot seeds"),
) -> None:
    """lm-evaluation-harness on CKPT: starts `k3 serve CKPT` on a loopback port, runs lm-eval's local-completions
    model against it (loglikelihood, multiple-choice and generate_until tasks; the server's tokenizer), prints a
    results table, writes --output, stops the server (also on errors and Ctrl-C). Needs the `eval` extra:
    pip install -e '.\\[eval]'.

    Example (the local tasks read their JSONL from the working directory, hence the cd):
    cd tests/serve/lm_eval_task && k3 eval lm ../../../runs/tiny/final --tasks k3_python_mc,k3_python_gen
    --include-path .
    """
    # (the docstring's backslash escapes the brackets from rich markup in --help)
    import sys

    from k3.serve.lm_eval import LmEvalError, run_lm_eval

    try:
        run_lm_eval(ckpt, tasks.split(","), include_path=include_path, limit=limit, num_fewshot=num_fewshot,
                    batch_size=batch_size, device=device, dtype=dtype, port=port, max_model_len=max_model_len,
                    output=output, log_samples=log_samples, seed=seed)
    except LmEvalError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(code=2) from None
