"""`k3 export-hf CKPT --out DIR`: a release as a transformers directory that loads without k3 installed."""

from __future__ import annotations

from pathlib import Path

import typer

from k3.cli.errors import friendly_errors


@friendly_errors
def export_hf(
    ckpt: Path = typer.Argument(..., help="bf16 / fp32 release checkpoint directory (e.g. runs/tiny/final)"),
    out: Path = typer.Option(..., "--out", "-o", help="directory to write (new, empty, or an earlier export, "
                             "which is replaced)"),
) -> None:
    """Export a release for Hugging Face transformers: the release's files, config.json's auto_map, and
    modeling_k3.py generated from the installed k3's model code, so that
    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True) loads it where k3 is not installed.
    Quantized releases are refused: export the release they were made from. Design and limits: docs/hf.md.

    k3 export-hf runs/tiny/final --out runs/tiny/hf
    """
    from k3.model.hf_export import export_hf as run

    path = run(ckpt, out)
    typer.echo(f"wrote {path} (load it with AutoModelForCausalLM.from_pretrained({str(path)!r}, "
               "trust_remote_code=True))")
