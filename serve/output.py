"""Output processing of the engine: new tokens become text deltas, stop conditions, events to each request's sink, and
the per-token and per-request metrics (serving.md 1.2-1.4 and 3).

The engine frees a finished sequence's slot and pages first (the scheduler), then `finished` sends its last event.
"""

from __future__ import annotations

import time

import torch

from k3.model.tokenizer import K3Tokenizer

from .metrics import Metrics
from .request import SeqEvent, Sequence, TokenLogprob, token_logprob


class OutputProcessor:
    """Turns tokens into events. `record_metrics` off (the warm-up) records nothing."""

    def __init__(self, tok: K3Tokenizer, max_model_len: int, metrics: Metrics):
        self.tok, self.max_model_len, self.metrics = tok, max_model_len, metrics
        self.record_metrics = True
        self._n_gen, self._itl = 0, []  # this step's generated tokens and inter-token latencies

    def append(self, seq: Sequence, tok: int, lp: TokenLogprob | None, now: float) -> str | None:
        """Add one generated token: detokenize, check the stop conditions, stream the safe text. Returns the finish
        reason ("stop" | "length"; the engine then finishes the sequence with that token), "abort" when the
        client's sink failed, else None."""
        p = seq.params
        seq.output.append(tok)
        seq.counts[tok] = seq.counts.get(tok, 0) + 1
        if self.record_metrics:  # generation_tokens and the ITLs go to the registry once per step (`gauges`)
            if seq.t_first is None:
                self.metrics.observe("k3:time_to_first_token_seconds", now - seq.arrival)
            else:
                self._itl.append(now - seq.t_last)
            self._n_gen += 1
        if seq.t_first is None:
            seq.t_first = now
        seq.t_last = now
        finish = seq.add_text(tok, self.tok.eos_id)
        n_out = len(seq.output)
        if finish is None and (n_out >= p.max_tokens or len(seq.prompt) + n_out >= self.max_model_len):
            finish = "length"
        if finish is not None:
            if finish == "length":
                seq.text += seq.decoder.flush()  # an incomplete trailing character becomes U+FFFD
            return finish
        return None if self.emit(seq, seq.take_delta(), [tok], [lp] if lp is not None else None, None) else "abort"

    def finished(self, seq: Sequence, reason: str, *, token: int | None = None, lp: TokenLogprob | None = None,
                 error: str | None = None) -> None:
        """The last event of a sequence whose resources the engine has freed, and its per-request metrics."""
        seq.status, seq.finish_reason = "finished", reason
        delta = seq.text[seq.emitted:]
        seq.emitted = len(seq.text)
        now = time.monotonic()
        if self.record_metrics:
            m = self.metrics
            m.inc("k3:request_success", finished_reason=reason)
            m.observe("k3:e2e_request_latency_seconds", now - seq.arrival)
            m.observe("k3:request_prompt_tokens", len(seq.prompt))
            m.observe("k3:request_generation_tokens", len(seq.output))
            m.inc("k3:prompt_tokens", max(0, min(seq.num_computed, len(seq.prompt)) - seq.num_cached))
            if seq.t_first is not None and seq.t_scheduled is not None:
                m.observe("k3:request_prefill_time_seconds", seq.t_first - seq.t_scheduled)
                m.observe("k3:request_decode_time_seconds", now - seq.t_first)
        self.emit(seq, delta, [] if token is None else [token], None if lp is None else [lp], reason, error=error)

    def emit(self, seq: Sequence, text: str, toks: list[int], lps, finish: str | None,
             error: str | None = None) -> bool:
        """Send one event to the sequence's sink; False when the sink raised (a broken client must not stop the
        engine: the caller aborts the sequence)."""
        ev = SeqEvent(seq_id=seq.seq_id, index=seq.index, text=text, token_ids=toks, logprobs=lps,
                      finish_reason=finish, num_prompt_tokens=len(seq.prompt), num_cached_tokens=seq.num_cached,
                      num_output_tokens=len(seq.output), error=error)
        if not seq.sent_first:
            seq.sent_first = True
            if seq.params.prompt_logprobs is not None:
                ev.prompt_logprobs = seq.prompt_lp
        try:
            seq.sink(ev)
        except Exception:  # noqa: BLE001 - a broken client sink must not stop the engine
            return finish is not None
        return True

    def prompt_logprobs(self, seq: Sequence, start: int, n: int, logits_TV: torch.Tensor) -> None:
        """Gather the logprobs of prompt tokens start + 1 .. start + n from a chunk's logits [n, V] (row j predicts
        prompt token start + j + 1)."""
        if start == 0:
            seq.prompt_lp.append(None)
        lsm = torch.log_softmax(logits_TV.float(), -1)
        for j in range(n):
            i = start + j + 1
            if i < len(seq.prompt):
                seq.prompt_lp.append(token_logprob(lsm[j], seq.prompt[i], seq.params.prompt_logprobs))

    def gauges(self, running: int, waiting: int, kv_usage: float, slot_usage: float) -> None:
        """The step's per-token series (one registry call each, not two per token) and the scheduler gauges."""
        if not self.record_metrics:
            return
        m = self.metrics
        if self._n_gen:
            m.inc("k3:generation_tokens", self._n_gen)
            m.observe_many("k3:inter_token_latency_seconds", self._itl)
            self._n_gen, self._itl = 0, []
        m.set("k3:num_requests_running", running)
        m.set("k3:num_requests_waiting", waiting)
        m.set("k3:kv_cache_usage_perc", kv_usage)
        m.set("k3:kda_state_slots_usage_perc", slot_usage)

    def acceptance(self, drafts: list[int], a: int) -> None:
        """Count one verify step with `a` of its drafts accepted in the k3:spec_decode_* counters (vLLM's names;
        position label 0-based)."""
        if not self.record_metrics:
            return
        m = self.metrics
        m.inc("k3:spec_decode_num_drafts")
        m.inc("k3:spec_decode_num_draft_tokens", len(drafts))
        m.inc("k3:spec_decode_num_accepted_tokens", a)
        for pos in range(a):
            m.inc("k3:spec_decode_num_accepted_tokens_per_pos", position=pos)
