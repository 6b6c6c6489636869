"""Tables and one loss-by-position plot from the eval directories run.sh writes (EVAL/<name>/passkey.json, loss.json).

    python examples/extend_context/summarize.py runs/extend-context/eval parent nope rope rope4x
"""

import json
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def main(root: Path, names: list[str]) -> None:
    pk = {n: json.loads((root / n / "passkey.json").read_text()) for n in names}
    ls = {n: json.loads((root / n / "loss.json").read_text()) for n in names}
    lengths = pk[names[0]]["lengths"]
    print(f"Passkey accuracy by length (mean over {len(pk[names[0]]['depths'])} depths x {pk[names[0]]['trials']} "
          f"trials; exact match):\n")
    print("| checkpoint | position | trained at | " + " | ".join(str(L) for L in lengths) + " |")
    print("|---|---|---|" + "---|" * len(lengths))
    for n in names:
        p = pk[n]
        cells = " | ".join(f"{p['by_length'][str(L)]:.0%}" for L in lengths)
        theta = f", theta {p['rope_theta']:g}" if p["mla_position"] == "rope" else ""
        print(f"| {n} | {p['mla_position']}{theta} | {p['trained_seq_len']} | {cells} |")
    T = ls[names[0]]["seq_len"]
    buckets = ls[names[0]]["buckets"]
    print(f"\nValidation loss (nats/token) by input position at {T} tokens, and bits per byte over all positions:\n")
    print("| checkpoint | " + " | ".join(f"{b['start']}-{b['end'] - 1}" for b in buckets[-6:]) + " | all | bpb |")
    print("|---|" + "---|" * (len(buckets[-6:]) + 2))
    for n in names:
        r = ls[n]
        cells = " | ".join(f"{b['loss']:.3f}" for b in r["buckets"][-6:])
        print(f"| {n} | {cells} | {r['loss']:.3f} | {r['bpb']:.3f} |")
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for n in names:
        b = [x for x in ls[n]["buckets"] if x["start"] >= 1]
        ax.plot([x["start"] for x in b], [x["loss"] for x in b], "o-", label=f"{n} ({pk[n]['mla_position']})")
    for L, style in ((256, ":"), (1024, "--")):
        ax.axvline(L, color="grey", ls=style, lw=1)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="input position (bucket start)", ylabel="cross-entropy (nats/token)",
           title=f"loss by position at {T} tokens (dotted: parent's 256, dashed: children's 1024)")
    ax.legend()
    fig.savefig(root / "loss_by_position.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
