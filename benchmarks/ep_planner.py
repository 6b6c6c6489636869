"""Dynamic expert parallelism on the host: max / mean tokens per EP rank without a plan, with the planner
(k3.train.parallel.planner), its stated bound and the lower bound for any plan; the planner's time per MoE layer; and
the counted all-to-all bytes per token of latent against full-width dispatch (k3.train.parallel.comm).

    python benchmarks/ep_planner.py [--shapes 64x8 896x64] [--redundant 0 1 2] [--tokens 1048576] [--seeds 5]

Count vectors: Zipf(s) over the experts in a random order (s = 1.0, 1.5, 2.0), the same with the hottest experts all
owned by rank 0, uniform random, all tokens on one expert, all on one rank's experts. Each row is the mean over seeds
(the worst seed in brackets for the planned column). Anchor: no plan (the static placement, R = 0).
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from k3.cli.config import load_model_config
from k3.model.config import ModelConfig
from k3.train.parallel.comm import ep_dispatch_bytes
from k3.train.parallel.planner import load_bound, lower_bound, plan_experts, rank_loads, static_loads


def count_vectors(E: int, P: int, tokens: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    def zipf(s, shuffle=True):
        w = 1.0 / np.arange(1, E + 1) ** s
        return np.floor(tokens * (w[rng.permutation(E)] if shuffle else w) / w.sum())

    one_expert, one_rank = np.zeros(E), np.zeros(E)
    one_expert[rng.integers(E)] = tokens
    r = rng.integers(P)
    one_rank[r * E // P:(r + 1) * E // P] = tokens * P / E
    return {"zipf 1.0": zipf(1.0), "zipf 1.5": zipf(1.5), "zipf 2.0": zipf(2.0), "zipf 1.5 rank 0": zipf(1.5, False),
            "random": rng.integers(0, 2 * tokens // E, E).astype(float), "one expert": one_expert,
            "one rank": one_rank}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["64x8", "896x64"], help="EXPERTSxRANKS, e.g. 896x64 (K3's E)")
    ap.add_argument("--redundant", nargs="+", type=int, default=[0, 1, 2], help="redundant slots per rank R")
    ap.add_argument("--tokens", type=int, default=1 << 20, help="routed rows per step (tokens x top-K)")
    ap.add_argument("--seeds", type=int, default=5, help="random count vectors per kind")
    args = ap.parse_args()
    plan_experts(np.ones(8), 2, 1)  # scipy's import and HiGHS' first call stay out of the first row's time
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, numpy {np.__version__}")
    print("| E x P | R | counts | static | planned (worst) | bound B | lower bound | plan ms |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        E, P = (int(v) for v in shape.split("x"))
        for R in args.redundant:
            rows: dict[str, list] = {}
            for seed in range(args.seeds):
                for name, c in count_vectors(E, P, args.tokens, np.random.default_rng(seed)).items():
                    t0 = time.perf_counter()
                    plan = plan_experts(c, P, R)
                    ms = 1e3 * (time.perf_counter() - t0)
                    mean = c.sum() / P
                    rows.setdefault(name, []).append((static_loads(c, P).max() / mean, rank_loads(c, plan).max() / mean,
                                                      load_bound(c, plan) / mean, lower_bound(c, P, R) / mean, ms))
            for name, vals in rows.items():
                v = np.array(vals)
                m = v.mean(0)
                print(f"| {E} x {P} | {R} | {name} | {m[0]:.3f} | {m[1]:.3f} ({v[:, 1].max():.3f}) | {m[2]:.3f} | "
                      f"{m[3]:.3f} | {m[4]:.1f} |")
    print("\n| model | EP | latent B/token/layer | full B/token/layer | latent / full | latent B/token/step |")
    print("|---|---|---|---|---|---|")
    small = load_model_config("k3-small")
    small_name = (f"k3-small (d {small.d_model}, l {small.moe_latent_size}, top-{small.num_experts_per_tok}, "
                  f"{small.mlp_types.count('moe')} MoE layers)")
    for name, cfg in ((small_name, small),
                      ("K3 (d 7168, l 3584, top-16, 92 MoE layers)",
                       ModelConfig(d_model=7168, moe_latent_size=3584, num_experts_per_tok=16, n_layers=93))):
        for ep in (8, 64):
            b = ep_dispatch_bytes(cfg, ep, dtype_bytes=2)
            print(f"| {name} | {ep} | {b['latent_layer']:.0f} | {b['full_layer']:.0f} | {b['ratio']:.2f} | "
                  f"{b['latent_step']:.0f} |")


if __name__ == "__main__":
    main()
