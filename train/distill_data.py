"""The prompts of `k3 distill`: reading FILE.jsonl, routing each prompt to its teacher, and sampling batches.

One JSON object per line: `prompt` (text, encoded with BOS as `k3 generate` does) or `messages` (a chat, rendered
with the checkpoint's ChatML template and a generation prompt), and optionally `teacher` (a --teacher NAME). Lines
without a teacher follow `distill.routing`:
    named    to `distill.default_teacher` (or the only teacher when there is one),
    uniform  to a teacher drawn uniformly at random each time the prompt is sampled,
    all      to every teacher: the teachers' log-probabilities are averaged (then renormalized).
Every check runs on the whole file before any work, with the line it concerns in the message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3.model.config import ConfigError
from k3.model.tokenizer import K3Tokenizer

ROUTINGS = ("named", "uniform", "all")
ALL = -1  # the route of a prompt scored by the average of every teacher


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]  # the prompt's token ids (BOS first)
    teacher: str | None  # the line's `teacher`, else None (routing decides)
    line: int  # 1-based line number in the prompts file
    where: str  # "path:line", for messages


def read_prompts(path: str | Path, tok: K3Tokenizer, teachers: list[str], *, context: int | None,
                 max_new_tokens: int) -> list[Prompt]:
    """Parse and tokenize the prompts file; ConfigError naming the line for a bad line, an unknown teacher or a
    prompt that with `max_new_tokens` does not fit the context (`context` tokens; None: no limit).

    Example: read_prompts("prompts.jsonl", tok, ["code", "prose"], context=256, max_new_tokens=64)"""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--prompts {path}: no such file; give a JSONL file with one {{\"prompt\": ...}} or "
                          f"{{\"messages\": [...]}} object per line")
    out = []
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg}); each line is one JSON object") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}: expected a JSON object with 'prompt' or 'messages', got {type(obj).__name__}")
        teacher = obj.get("teacher")
        if teacher is not None and teacher not in teachers:
            raise ConfigError(f"{where}: teacher {teacher!r} is not defined by any --teacher (defined: "
                              f"{', '.join(teachers)}); add --teacher {teacher}=CKPT or fix the line")
        if isinstance(obj.get("prompt"), str) and obj["prompt"]:
            ids = tok.encode(obj["prompt"], add_bos=True)
        elif isinstance(obj.get("messages"), list) and obj["messages"]:
            try:
                text = tok.apply_chat_template(obj["messages"], add_generation_prompt=True)
            except TypeError as e:
                raise ConfigError(f"{where}: {e}") from None
            ids = tok.encode(text)  # the template starts with BOS
        else:
            raise ConfigError(f"{where}: needs a non-empty string 'prompt' or a list 'messages' (keys: {sorted(obj)})")
        if context is not None and len(ids) + max_new_tokens > context:
            raise ConfigError(f"{where}: the prompt's {len(ids)} tokens and distill.max_new_tokens={max_new_tokens} "
                              f"exceed the student's context of {context} tokens; shorten the prompt or lower "
                              f"distill.max_new_tokens to {max(context - len(ids), 0)}")
        out.append(Prompt(tuple(ids), teacher, n, where))
    if not out:
        raise ConfigError(f"--prompts {path}: no prompts in the file")
    return out


def check_routing(prompts: list[Prompt], teachers: list[str], routing: str, default_teacher: str | None) -> str | None:
    """Validate distill.routing / default_teacher against the prompts; returns the teacher unnamed lines go to under
    `named` (None for uniform / all)."""
    if routing not in ROUTINGS:
        raise ConfigError(f"distill.routing={routing!r}: use one of {', '.join(ROUTINGS)}")
    if default_teacher is not None and default_teacher not in teachers:
        raise ConfigError(f"distill.default_teacher={default_teacher!r} is not a --teacher (defined: "
                          f"{', '.join(teachers)})")
    if routing != "named":
        return None
    if default_teacher is None and len(teachers) == 1:
        return teachers[0]
    unnamed = next((p for p in prompts if p.teacher is None), None)
    if default_teacher is None and unnamed is not None:
        raise ConfigError(f"{unnamed.where}: no 'teacher' and no distill.default_teacher, with "
                          f"{len(teachers)} teachers; set --set distill.default_teacher=NAME, name the teacher on "
                          f"the line, or --set distill.routing=uniform (or all)")
    return default_teacher


class PromptSampler:
    """Batches of prompts and their routes, drawn with replacement; all randomness of batch k comes from (seed, k),
    so the position is one counter (state_dict) and a resumed run draws what the uninterrupted one drew.

    A batch: (prompts, routes, seeds, teacher_generated): routes[i] is a teacher index or ALL, seeds[i] the
    sampling seed of prompt i's completion, teacher_generated whether this batch's completions come from the
    teachers (a fraction `lmbda` of batches) rather than the student."""

    def __init__(self, prompts: list[Prompt], teachers: list[str], *, routing: str, default_teacher: str | None,
                 batch_size: int, seed: int, lmbda: float = 0.0):
        if not 0.0 <= lmbda <= 1.0:
            raise ConfigError(f"distill.lmbda={lmbda} must lie in [0, 1] (the fraction of steps on "
                              f"teacher-generated completions)")
        self.prompts, self.teachers, self.routing = prompts, teachers, routing
        self.default = check_routing(prompts, teachers, routing, default_teacher)
        self.batch_size, self.seed, self.lmbda = batch_size, seed, lmbda
        self.draws = 0

    def route(self, p: Prompt, rng: np.random.Generator) -> int:
        if p.teacher is not None:
            return self.teachers.index(p.teacher)
        if self.routing == "named":
            return self.teachers.index(self.default)
        if self.routing == "uniform":
            return int(rng.integers(len(self.teachers)))
        return ALL

    def __iter__(self):
        return self

    def __next__(self) -> tuple[list[Prompt], list[int], list[int], bool]:
        rng = np.random.default_rng([self.seed, self.draws])
        self.draws += 1
        idx = rng.integers(len(self.prompts), size=self.batch_size)
        prompts = [self.prompts[i] for i in idx]
        routes = [self.route(p, rng) for p in prompts]
        seeds = [int(s) for s in rng.integers(2**31 - 1, size=self.batch_size)]
        return prompts, routes, seeds, bool(rng.random() < self.lmbda)

    def state_dict(self) -> dict:
        return {"draws": self.draws, "seed": self.seed, "n_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.seed or state.get("n_prompts") != len(self.prompts):
            raise ConfigError(f"the checkpoint's prompt sampler had seed {state.get('seed')} over "
                              f"{state.get('n_prompts')} prompts, this run {self.seed} over {len(self.prompts)}; "
                              f"resume with the same --prompts and data.seed")
        self.draws = int(state["draws"])
