"""Synthetic passkey documents: one generator for `k3 extend-context`'s training mix and `k3 eval passkey`.

A passkey document (Mohtashami & Jaggi 2023, "Landmark Attention", arXiv 2305.16300, section 4.2) hides a random
5-digit key in filler text and asks for it at the end. k3's filler is a window of the model's own token stream
(the standard library's code for the default checkpoints), so the model is tested on its domain and not on the
repeated "The grass is green." sentences of the original, which a code model has never seen. Needle and question
are Python comments, the form a code model can read:

    <|endoftext|> filler[:cut] "\\n# The pass key is 48213. Remember it. 48213 is the pass key.\\n" filler[cut:]
    "\\n# What is the pass key? The pass key is" [" 48213\\n" in training documents]

`cut = round(depth * n_filler)`, so depth 0 puts the key first and depth 1 right before the question. Every draw
comes from a numpy Generator the caller seeds, so a document is a pure function of (seed, its coordinates).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from k3.model.tokenizer import K3Tokenizer

NEEDLE = "\n# The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n# What is the pass key? The pass key is"
ANSWER = " {key}\n"
KEY_DIGITS = 5


@dataclass(frozen=True)
class PasskeyDoc:
    """One document: `tokens` [length] ids, the `key` (5 digits), where the needle starts (`key_start`, a token
    index) and its `depth` in [0, 1]."""

    tokens: list[int]
    key: str
    key_start: int
    depth: float


def draw_key(rng: np.random.Generator) -> str:
    """A uniformly random 5-digit key without a leading zero (10000..99999)."""
    return str(int(rng.integers(10 ** (KEY_DIGITS - 1), 10 ** KEY_DIGITS)))


def min_doc_length(tok: K3Tokenizer) -> int:
    """Tokens a training document needs at least: separator, needle, question and answer of the longest-tokenizing
    of a few keys (digits split differently by a BPE), plus 8 tokens of filler."""
    keys = ("10000", "12345", "40404", "55555", "67890", "98765", "99999")
    return 1 + 8 + max(sum(len(p) for p in _parts(tok, k, True)) for k in keys)


def _parts(tok: K3Tokenizer, key: str, with_answer: bool) -> tuple[list[int], list[int], list[int]]:
    enc = lambda s: tok.encode(s, parse_special=False)
    return enc(NEEDLE.format(key=key)), enc(QUESTION), enc(ANSWER.format(key=key)) if with_answer else []


def make_passkey_doc(tok: K3Tokenizer, filler_N: np.ndarray, length: int, depth: float, rng: np.random.Generator,
                     *, with_answer: bool = False) -> PasskeyDoc:
    """A passkey document of exactly `length` tokens whose filler is a random window of `filler_N` (token ids).

    with_answer=False: the prompt of `k3 eval passkey` (it ends with the question); True: a training document that
    ends with the answer. Draws the key, then the filler window, from `rng`.
    Example: make_passkey_doc(tok, data.val.tokens, 1024, 0.5, np.random.default_rng(0)).key  # '42584'
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth must be in [0, 1], got {depth}")
    key = draw_key(rng)
    needle, question, answer = _parts(tok, key, with_answer)
    n_filler = length - 1 - len(needle) - len(question) - len(answer)
    if n_filler < 0:
        raise ValueError(f"a passkey document needs at least {length - n_filler} tokens, {length} were asked for; "
                         f"use a longer length")
    if len(filler_N) < n_filler:
        raise ValueError(f"the filler text holds {len(filler_N)} tokens, fewer than the {n_filler} a {length}-token "
                         f"passkey document needs; use shorter lengths or a larger data source")
    start = int(rng.integers(0, len(filler_N) - n_filler + 1))
    filler = [int(t) for t in filler_N[start:start + n_filler]]
    cut = round(depth * n_filler)
    tokens = [tok.eos_id, *filler[:cut], *needle, *filler[cut:], *question, *answer]
    return PasskeyDoc(tokens, key, 1 + cut, depth)


def passkey_correct(completion: str, key: str) -> bool:
    """Exact match: the completion's first number (after leading whitespace) is the key, digit for digit. A model
    that continues the filler, repeats the question or gives a longer or shorter number scores 0."""
    m = re.match(r"\s*(\d+)", completion)
    return m is not None and m.group(1) == key
