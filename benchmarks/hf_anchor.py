"""Hugging Face `transformers` generate anchors for the serving benchmark (issue 5): what a user would run instead.

    python benchmarks/hf_anchor.py --device cuda                      # k3-small-sized anchors, batch 1 and 32
    python benchmarks/hf_anchor.py --device cpu --tiny --new-tokens 16 --batch 1 4    # CPU smoke run
    python benchmarks/serve.py --model k3-small --device cuda --hf-anchor ...        # same run as the k3 rows

Two anchors with random weights, built from a k3 preset's sizes (default k3-small):
- `llama`: `LlamaForCausalLM`, the dense baseline. Hidden size, layers, vocab and head count of the preset
  (multi-head attention, head_dim = hidden / heads), SwiGLU width 8/3 * hidden rounded to 64 (Touvron et al. 2023,
  arXiv:2302.13971, section 2: "2/3 4d"); 164M parameters at k3-small's size.
- `qwen3next`: `Qwen3NextForCausalLM`, the closest hybrid in transformers (Gated DeltaNet, Yang et al. 2024,
  arXiv:2412.06464, plus gated full attention and MoE). Its default layout of 3 linear-attention layers to 1
  full-attention layer (full_attention_interval 4; k3-small's full layers are 4, 8, 12, 16 as well), linear heads
  = the preset's KDA heads and head dim, full-attention heads = the preset's MLA heads (head_dim 128, 2 KV heads, the
  Qwen3-Next default group size), and the preset's MoE: expert count, top-k, expert width, one shared expert as wide
  as the preset's shared experts together. At k3-small's size: 416M total, 152M active (k3-small: 274M / 150M).

Timing (`time_generate`): `model.generate` greedy (do_sample=False) on random prompt ids with
min_new_tokens = max_new_tokens, so EOS never ends a row early, in bf16 on CUDA and fp32 on the CPU, after one
warm-up generate of the same shape. Output tok/s = batch * new tokens / wall time of the whole generate. Prefill is
timed apart (median of a few generate calls with one new token: the prompt's forward plus the first token);
ms per decode step = (generate time - prefill time) / (new tokens - 1), the steps after the first token.
Qwen3-Next uses fla-core's Triton kernels for the gated delta rule when `fla` imports, else transformers' PyTorch
fallback; `qwen3_next_kernel_paths` reports which one transformers bound (decided when it imported the model file).

`transformers` is optional: nothing here imports it at module import time.

Legend: B batch, T prompt length, N new tokens.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import statistics
import time

import torch

ANCHORS = ("llama", "qwen3next")


def require_transformers():
    """Import and return `transformers`, or raise ImportError saying how to install it."""
    try:
        import transformers
        from transformers import Qwen3NextConfig  # noqa: F401  (added in transformers 4.57)
    except ImportError as e:
        raise ImportError(
            "the Hugging Face anchors need `transformers` >= 4.57 (Qwen3-Next) and, on CUDA, `fla-core` for the "
            "Gated DeltaNet kernels: `pip install transformers fla-core` (without touching torch: add --no-deps and "
            f"install what it lists as missing). Import failed with: {e}") from e
    return transformers


def _anchor_sizes(preset: str, tiny: bool) -> dict:
    """The sizes both anchors are built from: a k3 preset's, or a tiny CPU smoke size."""
    if tiny:  # 2 layers, hidden 64: only to show that the code path works
        return {"name": "tiny", "vocab": 512, "d": 64, "layers": 2, "heads": 2, "head_dim": 32, "lin_heads": 2,
                "lin_head_dim": 32, "experts": 4, "top_k": 2, "expert_ff": 32, "shared_ff": 64, "dense_ff": 128,
                "rope_theta": 10000.0, "eps": 1e-5, "tie": False}
    from k3.cli.config import load_model_config

    c = load_model_config(preset)
    if c.d_model % c.mla_num_heads:
        raise ValueError(f"{preset}: d_model {c.d_model} is not a multiple of mla_num_heads {c.mla_num_heads}; the "
                         "Llama anchor needs hidden = heads * head_dim")
    return {"name": preset, "vocab": c.vocab_size, "d": c.d_model, "layers": c.n_layers, "heads": c.mla_num_heads,
            "head_dim": c.v_head_dim, "lin_heads": c.kda_num_heads, "lin_head_dim": c.kda_head_dim,
            "experts": c.num_experts, "top_k": c.num_experts_per_tok, "expert_ff": c.moe_intermediate_size,
            "shared_ff": c.num_shared_experts * c.moe_intermediate_size, "dense_ff": c.dense_intermediate_size,
            "rope_theta": c.rope_theta, "eps": c.rms_norm_eps, "tie": c.tie_word_embeddings}


def llama_config(preset: str = "k3-small", *, tiny: bool = False):
    """`LlamaConfig` of the dense anchor at `preset`'s hidden size, layers, heads and vocab (or the tiny size)."""
    from transformers import LlamaConfig

    s = _anchor_sizes(preset, tiny)
    ff = max(64, round(8 * s["d"] / 3 / 64) * 64)  # SwiGLU width 8/3 d (LLaMA, arXiv:2302.13971), multiple of 64
    return LlamaConfig(vocab_size=s["vocab"], hidden_size=s["d"], intermediate_size=ff,
                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["heads"], head_dim=s["d"] // s["heads"], rms_norm_eps=s["eps"],
                       tie_word_embeddings=s["tie"], max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]})


def qwen3_next_config(preset: str = "k3-small", *, tiny: bool = False):
    """`Qwen3NextConfig` of the hybrid anchor: `preset`'s sizes, Qwen3-Next's default 3:1 linear:full layout and the
    preset's MoE shape (see the module docstring). The tiny size uses [linear, full] so both layer kinds run."""
    from transformers import Qwen3NextConfig

    s = _anchor_sizes(preset, tiny)
    kv = 2 if s["heads"] % 2 == 0 else 1  # Qwen3-Next's default has 2 KV heads
    extra = {"layer_types": ["linear_attention", "full_attention"]} if tiny else {}
    return Qwen3NextConfig(vocab_size=s["vocab"], hidden_size=s["d"], num_hidden_layers=s["layers"],
                           num_attention_heads=s["heads"], num_key_value_heads=kv, head_dim=s["head_dim"],
                           linear_num_key_heads=s["lin_heads"], linear_num_value_heads=s["lin_heads"],
                           linear_key_head_dim=s["lin_head_dim"], linear_value_head_dim=s["lin_head_dim"],
                           num_experts=s["experts"], num_experts_per_tok=s["top_k"],
                           moe_intermediate_size=s["expert_ff"], shared_expert_intermediate_size=s["shared_ff"],
                           intermediate_size=s["dense_ff"], rms_norm_eps=s["eps"], tie_word_embeddings=s["tie"],
                           max_position_embeddings=4096, **extra)


def param_counts(model) -> dict[str, int]:
    """total / active parameters; active counts top-k of the routed experts (`.experts.` tensors scaled by k/E)."""
    total = sum(p.numel() for p in model.parameters())
    cfg = model.config
    e, k = getattr(cfg, "num_experts", 0), getattr(cfg, "num_experts_per_tok", 0)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) if e else 0
    return {"total": total, "active": total - routed * (e - k) // max(e, 1)}


def qwen3_next_kernel_paths() -> dict[str, str]:
    """Which implementation transformers bound for each Qwen3-Next kernel: 'fla (module)' / 'causal_conv1d (...)' or
    'torch fallback'. transformers >= 5 wraps each torch reference function and keeps the chosen one in the wrapper's
    closure as `implementation`; older versions have module-level `chunk_gated_delta_rule` (None without fla)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as mq

    out = {}
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        fn = getattr(mq, name, None)
        if fn is None:
            continue
        impl = None
        try:
            impl = inspect.getclosurevars(fn).nonlocals.get("implementation")
        except (TypeError, ValueError):
            pass
        if impl is None:
            out[name] = "unknown (transformers layout not recognised)"
        elif getattr(impl, "__module__", "").startswith("transformers."):
            out[name] = "torch fallback"
        else:
            out[name] = f"{impl.__module__.split('.')[0]} ({impl.__module__}.{impl.__name__})"
    if not out:  # transformers 4.x: module globals, None when the package is missing
        for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update"):
            impl = getattr(mq, name, None)
            out[name] = "torch fallback" if impl is None else f"{impl.__module__.split('.')[0]} ({impl.__module__})"
    return out


def describe_paths(paths: dict[str, str]) -> str:
    """One line: 'gated delta rule: fla, causal conv1d: torch fallback'."""
    delta = {v.split(" (")[0] for k, v in paths.items() if "delta_rule" in k}
    conv = {v.split(" (")[0] for k, v in paths.items() if "conv1d" in k}
    return f"gated delta rule: {'/'.join(sorted(delta))}, causal conv1d: {'/'.join(sorted(conv))}"


def build_anchor(kind: str, *, preset: str = "k3-small", tiny: bool = False, device: str = "cpu", seed: int = 0):
    """Random-weight `kind` ('llama' | 'qwen3next') on `device` (bf16 on CUDA, fp32 on the CPU), in eval mode.

    Returns (model, info) with info = {label, params: {total, active}, dtype, attn, experts, paths}.
    """
    require_transformers()
    from transformers import LlamaForCausalLM, Qwen3NextForCausalLM

    if kind not in ANCHORS:
        raise ValueError(f"unknown anchor {kind!r}; choose from {', '.join(ANCHORS)}")
    cfg = llama_config(preset, tiny=tiny) if kind == "llama" else qwen3_next_config(preset, tiny=tiny)
    cls = LlamaForCausalLM if kind == "llama" else Qwen3NextForCausalLM
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    paths = qwen3_next_kernel_paths() if kind == "qwen3next" else {}
    if torch.device(device).type == "cpu" and any(v.startswith("fla") for v in paths.values()):
        raise RuntimeError("transformers bound fla-core's Triton GPU kernels for Qwen3-Next, which do not run on the "
                           "CPU: run the anchor with --device cuda, or without fla-core installed on the CPU")
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(cfg)  # post_init draws the random weights (normal, std initializer_range)
    model = model.to(dtype).eval()
    n = param_counts(model)
    size = f"{n['total'] / 1e6:.3g}M" if n["active"] == n["total"] else \
        f"{n['total'] / 1e6:.3g}M/{n['active'] / 1e6:.3g}M act"
    label = f"HF {'Llama' if kind == 'llama' else 'Qwen3-Next'} {size}"
    info = {"label": label, "params": n, "dtype": str(dtype).removeprefix("torch."),
            "attn": getattr(model.config, "_attn_implementation", "?"),
            "experts": getattr(model.config, "_experts_implementation", None) if kind == "qwen3next" else None,
            "paths": paths}
    return model, info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_generate(model, *, batch: int, prompt_len: int, new_tokens: int, seed: int = 0,
                  warmup_new_tokens: int | None = None, prefill_repeats: int = 3) -> dict:
    """Greedy `model.generate` on random prompts ids_BT [B, T] -> [B, T + N]; timings after one warm-up run.

    warmup_new_tokens: new tokens of the warm-up generate (None = `new_tokens`, the same shape as the timed run).
    Returns {batch, prompt_len, new_tokens, total_s, prefill_ms, ms_per_step, out_tok_s}.
    """
    if batch < 1 or prompt_len < 1 or new_tokens < 2:
        raise ValueError(f"need batch >= 1, prompt_len >= 1 and new_tokens >= 2 (got {batch}, {prompt_len}, "
                         f"{new_tokens}): ms per decode step divides by new_tokens - 1")
    dev = model.device
    g = torch.Generator().manual_seed(seed)
    ids_BT = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).to(dev)
    mask_BT = torch.ones_like(ids_BT)

    def run(n: int) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        out_BTN = model.generate(input_ids=ids_BT, attention_mask=mask_BT, do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0)
        _sync(dev)
        dt = time.perf_counter() - t0
        if tuple(out_BTN.shape) != (batch, prompt_len + n):  # guards the tok/s arithmetic
            raise RuntimeError(f"generate returned shape {tuple(out_BTN.shape)}, expected {(batch, prompt_len + n)}")
        return dt

    run(warmup_new_tokens or new_tokens)  # warm-up: kernel selection / Triton autotune / allocator, excluded
    prefill = statistics.median(run(1) for _ in range(prefill_repeats))
    total = run(new_tokens)
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "total_s": total,
            "prefill_ms": 1e3 * prefill, "ms_per_step": 1e3 * (total - prefill) / (new_tokens - 1),
            "out_tok_s": batch * new_tokens / total}


def run_anchors(kinds=ANCHORS, *, preset: str = "k3-small", tiny: bool = False, device: str = "cpu",
                batches=(1, 32), prompt_len: int = 128, new_tokens: int = 256,
                warmup_new_tokens: int | None = None, log=print) -> list[dict]:
    """Build each anchor in turn, time it at every batch size, free it. One row per (anchor, batch):
    time_generate's dict plus label, params, dtype, attn, experts, paths (see build_anchor)."""
    rows = []
    for kind in kinds:
        model, info = build_anchor(kind, preset=preset, tiny=tiny, device=device)
        p = info["params"]
        extra = f", experts {info['experts']}, {describe_paths(info['paths'])}" if kind == "qwen3next" else ""
        log(f"{info['label']}: {p['total']:,} params total, {p['active']:,} active; {info['dtype']} on {device}, "
            f"attention {info['attn']}{extra}")
        for b in batches:
            r = time_generate(model, batch=b, prompt_len=prompt_len, new_tokens=new_tokens,
                              warmup_new_tokens=warmup_new_tokens)
            rows.append({**info, **r})
        del model
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_rows(rows: list[dict]) -> None:
    """Table of run_anchors' rows."""
    hdr = f"{'anchor':<34} {'batch':>5} {'out tok/s':>10} {'ms/step':>9} {'prefill ms':>10}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['label']:<34} {r['batch']:>5} {r['out_tok_s']:>10.1f} {r['ms_per_step']:>9.2f} "
              f"{r['prefill_ms']:>10.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--anchors", nargs="+", choices=ANCHORS, default=list(ANCHORS))
    ap.add_argument("--preset", default="k3-small", help="k3 model preset whose sizes the anchors take")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, vocab 512 (CPU smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--warmup-new-tokens", type=int, default=0, help="new tokens of the warm-up run (0 = same as "
                                                                     "--new-tokens)")
    args = ap.parse_args()
    transformers = require_transformers()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    rows = run_anchors(args.anchors, preset=args.preset, tiny=args.tiny, device=args.device, batches=args.batch,
                       prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                       warmup_new_tokens=args.warmup_new_tokens or None)
    print(f"\nmodel.generate greedy, prompt {args.prompt_len}, {args.new_tokens} new tokens ({args.device})")
    print_rows(rows)


if __name__ == "__main__":
    main()
