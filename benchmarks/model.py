"""Forward+backward training throughput of a K3 model against a dense Llama-style anchor of the same width/depth.

    python benchmarks/model.py --model k3-tiny --device cpu --batch 8 --seq 256
    python benchmarks/model.py --model k3-small --device cuda --batch 8 --seq 4096
    K3_KDA_RECOMPUTE=1 python benchmarks/model.py --model k3-small --device cuda --batch 1 --seq 131072 \
        --activation-checkpointing all --loss-chunk 8192 --no-anchor

Both models run one full training step (forward, CE loss, backward; no optimizer) in the same process on the same
batch. The anchor is a plain Pre-LN transformer (SDPA causal attention with d/64 heads, SwiGLU MLP sized to match
the K3 model's *active* non-embedding parameters, same vocab), i.e. what a user would train instead. Prints a
table with tokens/s, ms/step, model FLOPs utilisation (6 * active params * tokens + attention) and the ratio to the
anchor. Timing: warmup steps, then the median of --steps timed steps (CUDA synchronised). On CUDA the table adds
each model's peak allocated memory over its warmup and timed steps.

Long sequences: --activation-checkpointing mla|all recomputes the MLA layers' (or every layer's) mixer and MLP in
the backward (train.activation_checkpointing), --loss-chunk N computes the head and the losses over N-token chunks
(train.loss_chunk_tokens), K3_KDA_RECOMPUTE=1 makes the KDA backward recompute its chunk states (kernels.
kda_recompute), and --no-anchor skips the dense model (whose full attention and logits would not fit).

    python benchmarks/model.py --model k3-small --device cuda --batch 4 --seq 4096 --profile-ops 40

profiles one eager K3 step after the timing (torch.profiler, shapes recorded) and prints where its device time goes:
by module kind in the forward (KDA, MLA, LatentMoE, ...: the kernels launched inside each, annotated by hooks), by
autograd node in the backward, and the top aten ops by their own device time with their input shapes: the
attribution behind choosing the next fusion (the kernel-name categories of model_breakdown.py cannot say which op
an elementwise kernel came from).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from k3.cli.config import load_model_config
from k3.kernels.dispatch import active_config
from k3.model.transformer import build_model, count_parameters
from k3.train.loop import lm_losses


class DenseBlock(nn.Module):
    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 2 * ff, bias=False), nn.Linear(ff, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.heads, D // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        g, u = self.up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class DenseLM(nn.Module):
    """Llama-style anchor (RMSNorm, SDPA, SwiGLU, untied head)."""

    def __init__(self, vocab: int, d: int, layers: int, ff: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(DenseBlock(d, max(1, d // 64), ff) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def anchor_for(cfg, active_nonembed: int) -> DenseLM:
    d, L = cfg.d_model, cfg.n_layers
    # 4 d^2 attention + 3 d ff MLP per layer matches the K3 model's active non-embedding parameters
    ff = max(64, int((active_nonembed / L - 4 * d * d) / (3 * d)) // 64 * 64)
    return DenseLM(cfg.vocab_size, d, L, ff)


def measured_matmul_tflops(dev: torch.device) -> float:
    """Square matmul rate on this device (bf16 on CUDA, fp32 on CPU): the MFU denominator."""
    cuda = dev.type == "cuda"
    n, dt = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
    t = time_steps(lambda: a @ b, steps=5, warmup=2, cuda=cuda)
    return 2 * n**3 / t / 1e12


def time_steps(step, steps: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


FORWARD_KINDS = {"KimiDeltaAttention": "KDA", "GatedMLA": "MLA", "LatentMoE": "LatentMoE", "MTPModule": "MTP",
                 "Router": "LatentMoE.router", "GroupedExperts": "LatentMoE.experts", "RMSNorm": "RMSNorm",
                 "GatedMLP": "GatedMLP (dense, shared)", "Embedding": "embedding"}


def profile_ops(step, model: nn.Module, top: int, cuda: bool) -> None:
    """One eager `step()` under torch.profiler (CPU + CUDA, shapes): device time by forward module kind, by
    backward autograd node, and the `top` aten ops by self device time with their input shapes (CPU time on a
    CPU)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    open_ranges = []

    def pre(mod, inp):
        rf = record_function("fwd::" + FORWARD_KINDS[type(mod).__name__])
        rf.__enter__()
        open_ranges.append(rf)

    def post(mod, inp, out):
        open_ranges.pop().__exit__(None, None, None)

    hooks = []
    for mod in model.modules():
        if type(mod).__name__ in FORWARD_KINDS:
            hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()  # warm-up with the hooks in place
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=True) as prof:
        with record_function("step::whole"):
            step()
        sync()
    for h in hooks:
        h.remove()
    kind = "device" if cuda else "cpu"
    dev_total = lambda e: getattr(e, f"{kind}_time_total", 0.0)  # µs, the op and its children
    dev_self = lambda e: getattr(e, f"self_{kind}_time_total", 0.0)
    avgs = prof.key_averages()
    busy = sum(dev_self(e) for e in avgs)
    print(f"\nprofiled eager step: device busy {busy / 1e3:.1f} ms (sum of kernel times)")
    print(f"{'forward module kind (nested kinds counted in both)':<52} {'calls':>6} {'device ms':>10}")
    for e in sorted((e for e in avgs if e.key.startswith("fwd::")), key=lambda e: -dev_total(e)):
        print(f"{e.key[5:]:<52} {e.count:>6} {dev_total(e) / 1e3:>10.2f}")
    print(f"\n{'backward autograd node':<72} {'calls':>6} {'device ms':>10}")
    nodes = [e for e in avgs if e.key.startswith("autograd::engine::evaluate_function: ")]
    for e in sorted(nodes, key=lambda e: -dev_total(e))[:top]:
        print(f"{e.key.split(': ', 1)[1][:72]:<72} {e.count:>6} {dev_total(e) / 1e3:>10.2f}")
    print(f"\n{'aten op [input shapes]':<110} {'calls':>6} {'self dev ms':>11}")
    by_shape = prof.key_averages(group_by_input_shape=True)
    ops = [e for e in by_shape if dev_self(e) > 0 and not e.key.startswith(("fwd::", "step::", "autograd::"))]
    for e in sorted(ops, key=lambda e: -dev_self(e))[:top]:
        shapes = ",".join("x".join(map(str, s)) for s in (e.input_shapes or []) if s)
        print(f"{(e.key + ' [' + shapes + ']')[:110]:<110} {e.count:>6} {dev_self(e) / 1e3:>11.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3-tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="device peak for MFU (default: the matmul rate measured here, bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--no-mtp", action="store_true", help="drop the MTP branch")
    ap.add_argument("--activation-checkpointing", choices=("none", "mla", "all"), default="none",
                    help="recompute the MLA layers' or every layer's mixer and MLP in the backward")
    ap.add_argument("--loss-chunk", type=int, default=0, help="head + CE over chunks of this many tokens (0 = whole)")
    ap.add_argument("--no-anchor", action="store_true", help="time the K3 model only")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="capture each model's whole step (forward, loss, backward) in one CUDA graph and time its "
                         "replays: the host's kernel launches leave the step, the device's work stays")
    ap.add_argument("--compile", action="store_true", help="torch.compile each model (default mode) before timing")
    ap.add_argument("--profile-ops", type=int, default=0, metavar="N",
                    help="after the timing, profile one eager K3 step and print its device time by forward module, "
                         "by backward node and the top N aten ops with shapes")
    args = ap.parse_args()
    if args.cuda_graph and not torch.cuda.is_available():
        ap.error("--cuda-graph needs a CUDA device (run on the GPU, or drop the flag)")

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    # autocast's cast cache would hand a captured graph tensors freed after capture: off under --cuda-graph
    amp = (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not args.cuda_graph) if cuda
           else torch.autocast("cpu", enabled=False))
    cfg = load_model_config(args.model)
    torch.manual_seed(0)
    k3 = build_model(cfg, seed=0).to(dev)
    counts = count_parameters(k3)
    dense = anchor_for(cfg, counts["active_nonembed"]).to(dev)
    # FLOPs count the head but not the embedding table (a lookup)
    dense_active = sum(p.numel() for p in dense.parameters()) - dense.emb.weight.numel()
    k3_active = counts["active"] - k3.model.embed_tokens.weight.numel()
    B, T, V = args.batch, args.seq, cfg.vocab_size
    tokens = torch.randint(0, V, (B, T + 1), device=dev)

    k3.model.activation_checkpointing = args.activation_checkpointing
    k3_fwd, dense_fwd = (torch.compile(k3), torch.compile(dense)) if args.compile else (k3, dense)

    def k3_step():
        with amp:  # the train loop's losses: CE + 0.3 x MTP CE, chunked with --loss-chunk
            losses = lm_losses(k3_fwd, tokens, None, with_mtp=not args.no_mtp, chunk_tokens=args.loss_chunk)
            loss = losses["ce"] + 0.3 * losses.get("mtp_ce", 0.0)
        loss.backward()

    def dense_step():
        with amp:
            logits = dense_fwd(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, V), tokens[:, 1:].reshape(-1))
        loss.backward()

    def eager(step, module):
        def run():
            step()
            module.zero_grad(set_to_none=True)
        return run

    def graphed(step, module):
        """The step captured once (after warm-up on a side stream, so Triton's autotuning and the lazy inits
        are done) and replayed: each replay writes the same .grad tensors."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(max(1, args.warmup)):
                eager(step, module)()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay

    wrap = graphed if args.cuda_graph else eager

    peak = args.peak_tflops or measured_matmul_tflops(dev)
    n_mla = cfg.layer_types.count("mla")
    rows = []
    runs = [("dense anchor", (dense_step, dense), dense_active, cfg.n_layers, cfg.d_model),
            (f"{args.model}", (k3_step, k3), k3_active + (0 if args.no_mtp else counts["mtp"]), n_mla,
             cfg.mla_num_heads * (cfg.qk_head_dim + cfg.v_head_dim) / 2)]
    if args.no_anchor:
        del dense
        runs = runs[1:]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for name, (step, module), active, attn_layers, hd in runs:
        t = time_steps(wrap(step, module), args.steps, args.warmup, cuda)
        flops = 6 * active * B * T + 6 * attn_layers * B * T * T * hd  # causal attention ~ half of 12*T*d
        rows.append((name, active, t, B * T / t, flops / t / 1e12 / peak))
        if cuda:
            rows[-1] += (torch.cuda.max_memory_allocated() / 2**30,)
            torch.cuda.reset_peak_memory_stats()
    print(f"\nfwd+bwd, B={B} T={T}, device={dev} ({torch.cuda.get_device_name() if cuda else 'cpu'}), "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}, MFU against {peak:.3f} TFLOP/s matmul; "
          f"activation checkpointing {args.activation_checkpointing}, loss chunk {args.loss_chunk or 'off'}, "
          f"KDA recompute {active_config().kda_recompute}, "
          f"{'one CUDA graph per step' if args.cuda_graph else 'eager launches'}"
          f"{', torch.compile' if args.compile else ''}")
    print(f"{'model':<14} {'FLOP params':>14} {'ms/step':>9} {'tokens/s':>11} {'MFU':>7} {'vs anchor':>10}"
          + (f" {'peak GiB':>9}" if cuda else ""))
    base = None if args.no_anchor else rows[0][3]
    for r in rows:
        ratio = f"{r[3] / base:>9.2f}x" if base else f"{'-':>10}"
        line = f"{r[0]:<14} {r[1] / 1e6:>13.1f}M {r[2] * 1e3:>9.1f} {r[3]:>11,.0f} {r[4] * 100:>6.1f}% {ratio}"
        print(line + (f" {r[5]:>9.1f}" if cuda else ""))
    if args.profile_ops:
        profile_ops(eager(k3_step, k3), k3, args.profile_ops, cuda)


if __name__ == "__main__":
    main()
