"""Engine-side request types: sampling parameters, per-sequence state, and the events streamed back.

One `Sequence` is one choice of one request (`n` choices = `n` sequences sharing a request id).
Legend: V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3.model.tokenizer import IncrementalDecoder


@dataclass(kw_only=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, (0, 1]
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens below min_p * max prob
    max_tokens: int = 16  # output cap (0 only with echo: score the prompt)
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop ids (the id is counted, its text not shown)
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    seed: int | None = None  # per-request sampling seed
    presence_penalty: float = 0.0  # subtract once per distinct generated token
    frequency_penalty: float = 0.0  # subtract per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # CTRL-style: divide positive / multiply negative logits of seen tokens
    logprobs: int | None = None  # None = off; k >= 0: chosen token's logprob plus the top-k
    prompt_logprobs: int | None = None  # None = off; k >= 0 like logprobs, for every prompt token (echo)
    skip_special_tokens: bool = True  # drop special tokens from the text


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # [(id, logprob)] best first


@dataclass
class SeqEvent:
    """What one engine step produced for one sequence (sent to the request's sink)."""

    seq_id: str
    index: int  # choice index within the request
    text: str  # new text (stop strings removed)
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first event only, when requested
    error: str | None = None


@dataclass(eq=False)
class Sequence:
    seq_id: str
    index: int
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[SeqEvent], None]
    decoder: IncrementalDecoder
    arrival: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    status: str = "waiting"  # waiting | running | finished
    slot: int = -1
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV/state are in the caches
    num_cached: int = 0  # prompt tokens restored from the prefix cache
    hashes: list[bytes] = field(default_factory=list)  # chained block hashes of prompt + output, as known
    text: str = ""  # decoded output text (after stop-string truncation)
    emitted: int = 0  # characters of `text` already sent
    generator: torch.Generator | None = None
    counts: dict[int, int] = field(default_factory=dict)  # generated token -> occurrences (penalties)
    prompt_lp: list = field(default_factory=list)  # prompt logprobs gathered chunk by chunk
    t_scheduled: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    finish_reason: str | None = None
    sent_first: bool = False
    spec: object | None = None  # k3.serve.proposer.SpecState while running with speculation

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)

    def add_text(self, tok: int, eos_id: int) -> str | None:
        """Detokenize generated token `tok` onto `text`; "stop" when it is a stop token (counted as output, its text
        not shown) or completes a stop string (`text` is cut where the stop string starts), else None."""
        p = self.params
        if (tok == eos_id and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        before = len(self.text)
        self.text += self.decoder.add(tok)
        if p.stop:
            cut = find_stop(self.text, p.stop, before)
            if cut is not None:
                self.text = self.text[:cut]
                return "stop"
        return None

    def take_delta(self) -> str:
        """The text not sent yet that cannot be the beginning of a stop string (marked sent)."""
        safe = len(self.text) - (holdback(self.text, self.params.stop) if self.params.stop else 0)
        delta = self.text[self.emitted:safe] if safe > self.emitted else ""
        self.emitted += len(delta)
        return delta


# ---------------------------------------------------------------------------------------------------- helpers


def token_logprob(lsm_V: torch.Tensor, tok: int, k: int) -> TokenLogprob:
    """The chosen token's logprob and the top-k [(id, logprob)] from a log-softmax row [V]."""
    top = []
    if k > 0:
        vals, ids = torch.topk(lsm_V, min(k, lsm_V.shape[-1]))
        top = list(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token_id=tok, logprob=float(lsm_V[tok]), top=top)


def find_stop(text: str, stops: list[str], before: int) -> int | None:
    """Earliest index where a stop string starts, searching only where a new match can begin."""
    best = None
    for s in stops:
        i = text.find(s, max(0, before - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def holdback(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that could be the beginning of a stop string (not sent yet)."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    return keep
