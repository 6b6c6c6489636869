"""Post-training quantization of a release checkpoint: the workflow behind `k3 quantize` (round-to-nearest of the
routed experts today; the format is k3.model.quant's, documented in model/README.md "Quantized release
checkpoints")."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from k3.model.checkpoint import CheckpointError, load_release, read_quantization_config, save_release
from k3.model.quant import quantize_state_dict


def quantize_release(src_dir: str | Path, out_dir: str | Path, fmt: str = "w4a8", group_size: int | None = 32, *,
                     run_info: dict | None = None) -> Path:
    """Read a bf16 / fp32 release, RTN-quantize its routed experts, write a new release (atomically, via
    save_release) with quantization_config in config.json; tokenizer files and generation_config.json are kept.

    Example: quantize_release("runs/x/final", "runs/x/final-q", fmt="w4a8", group_size=32)
    """
    src, out = Path(src_dir), Path(out_dir)
    if out.resolve() == src.resolve():
        raise CheckpointError(f"{out}: quantize_release writes a new release; choose an output directory other than "
                              "the source")
    if read_quantization_config(src) is not None:
        raise CheckpointError(f"{src}: already quantized ({read_quantization_config(src)['format']}); quantize the "
                              "bf16 / fp32 release instead")
    cfg, sd = load_release(src)
    qsd, qc = quantize_state_dict(sd, cfg, fmt, group_size)
    gen_path = src / "generation_config.json"
    gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else None
    parent_run = src / "k3_run.yaml"
    info = {"parent_checkpoint": str(src), "quantization": {**qc, "algorithm": "rtn"},
            **({"parent_run": yaml.safe_load(parent_run.read_text(encoding="utf-8"))}
               if parent_run.is_file() else {}), **(run_info or {})}
    tok = src if (src / "tokenizer.json").is_file() else None
    return save_release(out, qsd, cfg, tokenizer_dir=tok, run_info=info, generation_config=gen,
                        quantization_config=qc)
