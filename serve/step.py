"""What the runner takes and returns for one engine step (the scheduler's per-sequence work and the model's outputs).

Legend: N sequences, Tn new tokens of sequence n, T packed tokens, D width, V_ vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepSeq:
    """The work of one sequence in one step."""

    tokens: list[int]  # new tokens [Tn]
    start: int  # absolute position of tokens[0] (= tokens already in the caches)
    slot: int  # KDA working slot (-1: none, the MTP's calls)
    block_table: list[int]  # latent pages covering positions [0, start + Tn)
    logits: str = "last"  # "last" | "all" | "none": which positions' logits to return
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (boundary position p, snapshot entry)
    spec: bool = False  # verify step: keep the KDA state after every token so drafts can be rolled back


@dataclass
class StepOutput:
    logits: list[torch.Tensor | None]  # per sequence: [1, V_] ("last"), [Tn, V_] ("all") or None; fp32
    hidden_last: torch.Tensor  # [N, D] final hidden (before the final norm) at each sequence's last token
    hidden: torch.Tensor | None = None  # [T, D] final hidden of every packed token (rows cu[n]:cu[n+1])
    cu: list[int] = field(default_factory=list)  # [N+1] packed row offsets


@dataclass
class VerifyRecord:
    """What a verify step leaves for its rollback (ModelRunner.commit_spec): its sequences, row offsets in the
    static layout (n * T), the final hidden of those rows [N * T, D], the static buffers whose `pre` (pre-conv
    inputs) the rollback reads, and the accepted lengths collected so far (None until committed)."""

    seqs: list[StepSeq]
    cu: list[int]
    hidden: torch.Tensor
    buf: object
    kept: list[int | None]


def merge_outputs(parts: list[tuple[list[int], StepOutput]], n: int) -> StepOutput:
    """One StepOutput for a step of `n` sequences run as several calls: parts (the step's sequence indices of a call,
    its output) back in the step's order."""
    order = {i: (out, j) for idx, out in parts for j, i in enumerate(idx)}
    rows, logits, lasts, cu = [], [], [], [0]
    for i in range(n):
        out, j = order[i]
        a, b = out.cu[j], out.cu[j + 1]
        rows.append(out.hidden[a:b])
        logits.append(out.logits[j])
        lasts.append(out.hidden_last[j:j + 1])
        cu.append(cu[-1] + b - a)
    return StepOutput(logits=logits, hidden_last=torch.cat(lasts), hidden=torch.cat(rows), cu=cu)
