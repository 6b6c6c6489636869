"""Prometheus metrics of `k3 serve` (serving.md section 3): `k3:` names modelled on vLLM's, text exposition format.

A tiny thread-safe registry (counters, gauges, histograms with labels), rendered as the Prometheus text format
(https://prometheus.io/docs/instrumenting/exposition_formats/). Counter names are registered without `_total`
and exposed with it, as the Python client does. Every series carries `model_name`.

The engine records every generated token (a counter and an inter-token latency per token per sequence), so the hot
calls are cheap: the label-free series key is computed once, a histogram observation finds its bucket by bisection
and counts it there alone (buckets are made cumulative when rendered), and `observe_many` takes the lock once for a
step's worth of values.
"""

from __future__ import annotations

import bisect
import math
import threading

# vLLM's buckets (vllm/v1/metrics/loggers.py) for the latency histograms, in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def _fmt_labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = (str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc)) + "}"


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x)) if abs(x) < 1e15 else repr(float(x))


class Metrics:
    """Registry. `inc(name, v, **labels)`, `set(name, v)`, `observe(name, v)`; `render()` -> exposition text."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self._key0 = (("model_name", model_name),)  # the key of the label-free series (most calls)
        self._lock = threading.Lock()
        self._meta: dict[str, tuple[str, str, tuple | None]] = {}  # name -> (kind, help, buckets)
        self._values: dict[str, dict[tuple, object]] = {}
        for name, help_ in (("k3:num_requests_running", "Requests in the running batch."),
                            ("k3:num_requests_waiting", "Requests waiting to be scheduled."),
                            ("k3:kv_cache_usage_perc", "Fraction of latent cache pages in use (0-1)."),
                            ("k3:kda_state_slots_usage_perc", "Fraction of KDA state slots in use (0-1)."),
                            ("k3:time_to_ready_seconds", "Seconds from start to ready (loaded and warmed).")):
            self._register(name, "gauge", help_)
        for name, help_ in (("k3:prompt_tokens", "Prefill tokens processed (computed, cache hits excluded)."),
                            ("k3:generation_tokens", "Generated tokens."),
                            ("k3:request_success", "Finished requests by finish reason."),
                            ("k3:num_preemptions", "Recompute preemptions."),
                            ("k3:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
                            ("k3:prefix_cache_hits", "Prompt tokens served from the prefix cache."),
                            ("k3:state_checkpoint_hits", "Prefix hits restored from a KDA state snapshot."),
                            ("k3:state_checkpoint_evictions", "KDA snapshots evicted from the store."),
                            ("k3:requests_rejected", "Requests rejected before the engine, by reason."),
                            ("k3:spec_decode_num_drafts", "Speculative draft rounds."),
                            ("k3:spec_decode_num_draft_tokens", "Draft tokens proposed."),
                            ("k3:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
                            ("k3:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position.")):
            self._register(name, "counter", help_)
        for name, help_, b in (
                ("k3:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
                ("k3:inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS),
                ("k3:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS),
                ("k3:request_queue_time_seconds", "Time waiting in the queue.", E2E_BUCKETS),
                ("k3:request_prefill_time_seconds", "Time from scheduling to the first token.", E2E_BUCKETS),
                ("k3:request_decode_time_seconds", "Time from the first to the last token.", E2E_BUCKETS),
                ("k3:request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS),
                ("k3:request_generation_tokens", "Output length of finished requests.", TOKEN_BUCKETS),
                ("k3:iteration_tokens_total", "Tokens per engine step.", TOKEN_BUCKETS)):
            self._register(name, "histogram", help_, b)

    def _register(self, name: str, kind: str, help_: str, buckets: tuple | None = None) -> None:
        self._meta[name] = (kind, help_, buckets)
        self._values[name] = {}

    def _key(self, labels: dict) -> tuple:
        if not labels:
            return self._key0
        return tuple(sorted({"model_name": self.model_name, **{k: str(v) for k, v in labels.items()}}.items()))

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        with self._lock:
            d = self._values[name]
            k = self._key(labels)
            d[k] = d.get(k, 0.0) + value

    def set(self, name: str, value: float, **labels) -> None:
        with self._lock:
            self._values[name][self._key(labels)] = float(value)

    def observe(self, name: str, value: float, **labels) -> None:
        self.observe_many(name, (value,), **labels)

    def observe_many(self, name: str, values, **labels) -> None:
        """Observe each of `values` in histogram `name` (one lock acquisition)."""
        buckets = self._meta[name][2]
        k = self._key(labels)
        with self._lock:
            d = self._values[name]
            h = d.get(k)
            if h is None:
                # per-bucket counts (the last slot: above every bound, in +Inf only), sum, count
                h = d[k] = [[0] * (len(buckets) + 1), 0.0, 0]
            counts = h[0]
            for v in values:
                counts[bisect.bisect_left(buckets, v)] += 1  # the first bound b with v <= b
                h[1] += v
                h[2] += 1

    def get(self, name: str, **labels) -> float:
        """Current value of a counter/gauge series (0 if never touched); histograms give their count."""
        with self._lock:
            v = self._values[name].get(self._key(labels), 0.0)
        return float(v[2]) if isinstance(v, list) else float(v)

    def render(self) -> str:
        """Prometheus text exposition (version 0.0.4)."""
        lines = []
        with self._lock:
            for name, (kind, help_, buckets) in self._meta.items():
                exposed = name + "_total" if kind == "counter" else name
                lines.append(f"# HELP {exposed} {help_}")
                lines.append(f"# TYPE {exposed} {kind}")
                series = self._values[name] or ({self._key({}): 0.0} if kind != "histogram" else {})
                for key, v in series.items():
                    labels = dict(key)
                    if kind != "histogram":
                        lines.append(f"{exposed}{_fmt_labels(labels)} {_num(v)}")
                        continue
                    c = 0
                    for b, n in zip(buckets, v[0]):
                        c += n  # cumulative: observations <= b
                        lines.append(f"{name}_bucket{_fmt_labels({**labels, 'le': _num(b)})} {c}")
                    lines.append(f"{name}_bucket{_fmt_labels({**labels, 'le': '+Inf'})} {v[2]}")
                    lines.append(f"{name}_sum{_fmt_labels(labels)} {_num(v[1])}")
                    lines.append(f"{name}_count{_fmt_labels(labels)} {v[2]}")
        return "\n".join(lines) + "\n"
