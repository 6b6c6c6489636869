"""Request jobs of `k3 serve` (k3.serve.server): one HTTP request's sequences from submission to the response,
streamed (SSE in OpenAI's chunk format) or collected, and the hand-over of engine events to the event loop.

The engine thread emits one SeqEvent per sequence per step; `Delivery` moves them to the requests' mailboxes with
one loop wake-up per burst; `Job.batches` yields what each mailbox holds (None = an SSE ping after
sse_ping_interval_s of silence) and notices a client that disconnected, which aborts its sequences.

Per token and stream this is the server's hot path (~10,000 events/s at 32 streams on a GPU; measured by
benchmarks/serve_host.py --http), so: a Mailbox wait costs one future (no task or timer per event), text-only
chunks are formatted from a per-stream template (`ChunkTemplate`, the bytes json.dumps of the chunk dict gives),
and the chunks of events that arrived together go out in one write.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from json.encoder import encode_basestring

from fastapi import Request
from fastapi.responses import StreamingResponse

from .chat import ChatTemplate
from .config import ServeConfig
from .engine import Engine, EngineDead, QueueFull
from .metrics import Metrics
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    LogprobFormatter,
    merge_completion_logprobs,
    now,
    usage,
)
from .request import SeqEvent

log = logging.getLogger("k3.serve")


@dataclass
class ServerState:
    """What the routes share. `engine` is None until the model is loaded; ready after warmup."""

    cfg: ServeConfig
    model_name: str
    metrics: Metrics
    engine: Engine | None = None
    chat: ChatTemplate | None = None
    created: int = field(default_factory=now)
    load_error: str | None = None
    draining: bool = False  # shutting down: new requests get 503 "draining"
    in_flight: dict = field(default_factory=dict)  # API key ("" without keys) -> generation requests in flight
    delivery: Delivery | None = None  # engine thread -> event loop hand-over, created with the first request


class Delivery:
    """Hands engine events to the event loop's per-request queues with one loop wake-up per burst: the engine thread
    emits one event per running sequence each step, and waking the loop once per event (call_soon_threadsafe
    writes to the loop's self-pipe every time) cost a system call and a callback per token at high concurrency.
    A queue is anything with `put_nowait` (a Job's Mailbox, an asyncio.Queue)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[Mailbox | asyncio.Queue, SeqEvent]] = []

    def put(self, queue, ev: SeqEvent) -> None:  # engine thread
        with self.lock:
            self.pending.append((queue, ev))
            wake = len(self.pending) == 1  # the first of a burst schedules the drain; the rest ride along
        if wake:
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # event loop
        with self.lock:
            items, self.pending = self.pending, []
        for queue, ev in items:
            queue.put_nowait(ev)


class Mailbox:
    """One request's events on the event loop: `put_nowait` (Delivery's drain) appends and wakes the reader;
    `wait(timeout)` returns True once events are queued, False after `timeout` seconds without one.

    Cheaper per event than `asyncio.wait_for(queue.get(), timeout)`, which costs a task (Python < 3.12) and a timer
    per call: at 32 streams that was every token of every stream. Here a wait costs one future, and the timeout is a
    single timer per request, re-armed to the current wait's deadline when it fires early (at most once per
    `timeout` while events keep coming)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque[SeqEvent] = deque()
        self._waiter: asyncio.Future | None = None
        self._deadline = 0.0  # loop time at which the current wait times out
        self._timer: asyncio.TimerHandle | None = None

    def put_nowait(self, ev: SeqEvent) -> None:
        self.items.append(ev)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout: float) -> bool:
        if self.items:
            return True
        loop = self.loop
        self._deadline = loop.time() + timeout
        if self._timer is None:
            self._timer = loop.call_at(self._deadline, self._on_timer)
        self._waiter = loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        return bool(self.items)

    def _on_timer(self) -> None:
        self._timer = None
        w = self._waiter
        if w is None or w.done():
            return  # no wait in progress: the next wait arms a new timer
        if self.loop.time() >= self._deadline - 1e-3:
            w.set_result(None)  # timed out (the loop may run a timer up to its clock resolution early)
        else:
            self._timer = self.loop.call_at(self._deadline, self._on_timer)  # the wait started after this was armed

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def sse_response(gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


_JSON = json.JSONEncoder(ensure_ascii=False)  # json.dumps(..., ensure_ascii=False) builds an encoder per call
_STR = encode_basestring  # what _JSON.encode does with a str (the C encoder), minus the method call


def _data(obj) -> str:
    return f"data: {_JSON.encode(obj)}\n\n"


class ChunkTemplate:
    """SSE `data:` lines of the text-only stream chunks (no logprobs), formatted from preformatted pieces: the same
    bytes as `_data` of the chunk dict (json.dumps' default separators, keys in the dict's order), without building
    and encoding a dict per token per stream. `head` is the chunk's leading fields (id, object, created, model),
    `usage` adds the trailing `"usage": null` of include_usage streams."""

    def __init__(self, head: dict, usage: bool):
        self.prefix = "data: " + _JSON.encode(head)[:-1] + ', "choices": [{"index": '
        self.end = '}]' + (', "usage": null' if usage else "") + "}\n\n"
        self.reasons = {r: ', "logprobs": null, "finish_reason": ' + _JSON.encode(r) + self.end
                        for r in (None, "stop", "length", "abort")}

    def completion(self, index: int, text: str, reason: str | None) -> str:
        """{..head, "choices": [{"index", "text", "logprobs": null, "finish_reason"}]}"""
        return f'{self.prefix}{index}, "text": {_STR(text)}{self.reasons[reason]}'

    def chat_delta(self, index: int, text: str) -> str:
        """{..head, "choices": [{"index", "delta": {"content"}, "logprobs": null, "finish_reason": null}]}"""
        return f'{self.prefix}{index}, "delta": {{"content": {_STR(text)}}}{self.reasons[None]}'

    def chat_finish(self, index: int, reason: str) -> str:
        """{..head, "choices": [{"index", "delta": {}, "logprobs": null, "finish_reason"}]}"""
        return f'{self.prefix}{index}, "delta": {{}}{self.reasons[reason]}'


class Job:
    """One HTTP request's sequences: submission, the event queue, abort on disconnect, response assembly."""

    def __init__(self, state: ServerState, request: Request, rid: str):
        self.state, self.request, self.rid = state, request, rid
        self.engine = state.engine
        self.loop = asyncio.get_running_loop()
        self.queue = Mailbox(self.loop)
        self.seq_ids: list[str] = []
        self.n_seqs = 0
        self.created = now()
        self.fmt = LogprobFormatter(self.engine.tok)
        if state.delivery is None or state.delivery.loop is not self.loop:
            state.delivery = Delivery(self.loop)
        self.delivery = state.delivery

    def _sink(self, ev: SeqEvent) -> None:  # engine thread
        self.delivery.put(self.queue, ev)

    def submit(self, id_lists: list[list[int]], params: list, n: int) -> None:
        try:
            for k, (ids, p) in enumerate(zip(id_lists, params)):
                self.seq_ids += self.engine.submit(ids, p, self._make_sink(k * n), n=n, request_id=f"{self.rid}-{k}")
                self.n_seqs += n
        except QueueFull as e:
            self.abort()
            self.state.metrics.inc("k3:requests_rejected", reason="queue_full")
            raise APIError(503, f"server busy: {e}; retry later", type_="unavailable_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except EngineDead as e:
            self.abort()
            raise APIError(503, str(e), type_="unavailable_error", code="engine_dead") from None
        except ValueError as e:
            self.abort()
            raise APIError(400, str(e), code="invalid_parameter") from None

    def _make_sink(self, offset: int):
        if offset == 0:
            return self._sink

        def sink(ev: SeqEvent) -> None:
            ev.index += offset  # choice index across prompts x n
            self._sink(ev)
        return sink

    def abort(self) -> None:
        if self.seq_ids:
            self.engine.abort(self.seq_ids)

    async def batches(self):
        """Engine events until every sequence finished, as lists of the events queued at once (one per engine
        step when the loop keeps up; more when it fell behind, so a stream then sends them in one write); None (an
        SSE ping) when nothing arrived for sse_ping_interval_s. Raises ClientGone when the client disconnected."""
        left = self.n_seqs
        ping = self.state.cfg.sse_ping_interval_s
        tick = min(ping, 0.5)
        idle = 0.0
        box = self.queue
        try:
            while left:
                if not await box.wait(tick):
                    if await self.request.is_disconnected():
                        raise ClientGone() from None
                    idle += tick
                    if idle >= ping:
                        idle = 0.0
                        yield None
                    continue
                idle = 0.0
                evs, box.items = box.items, deque()
                for ev in evs:
                    if ev.finish_reason is not None:
                        left -= 1
                yield evs
        finally:
            box.close()

    # ---------------------------------------------------------------------------------------------- non-streaming

    async def _collect(self) -> dict[int, list[SeqEvent]]:
        by_index: dict[int, list[SeqEvent]] = {}
        try:
            async for evs in self.batches():
                for ev in evs or ():  # None: a ping
                    if ev.error:
                        raise APIError(500, ev.error, type_="server_error")
                    by_index.setdefault(ev.index, []).append(ev)
        except ClientGone:
            self.abort()
            raise APIError(499, "client closed the request", code="client_closed_request") from None
        except BaseException:
            self.abort()
            raise
        return by_index

    def _usage(self, by_index: dict[int, list[SeqEvent]], n_prompts: int) -> dict:
        firsts = [evs[-1] for _, evs in sorted(by_index.items())]
        n = max(1, len(firsts) // max(1, n_prompts))
        prompt = sum(e.num_prompt_tokens for e in firsts[::n])
        cached = sum(e.num_cached_tokens for e in firsts[::n])
        return usage(prompt, sum(e.num_output_tokens for e in firsts), cached)

    async def collect_completion(self, req: CompletionRequest, prompts, id_lists) -> dict:
        by_index = await self._collect()
        choices = []
        for i, evs in sorted(by_index.items()):
            k = i // req.n
            text = "".join(e.text for e in evs)
            lp = None
            if req.logprobs is not None:
                lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                if req.echo:
                    lp = self._prompt_logprobs(evs[0], id_lists[k])
                start = sum(len(t) for t in lp["tokens"])
                lp = merge_completion_logprobs(lp, self.fmt.completion([x for e in evs for x in (e.logprobs or [])],
                                                                       start))
            if req.echo:
                text = self._prompt_text(prompts[k], id_lists[k]) + text
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": _reason(evs[-1])})
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.state.model_name,
                "choices": choices, "usage": self._usage(by_index, len(id_lists))}

    def _prompt_text(self, prompt, ids) -> str:
        """Echoed prompt: the decoded prompt ids, special tokens (the BOS added to string prompts) included, so
        text_offset indexes the returned text."""
        return self.engine.tok.decode(ids)

    def _prompt_logprobs(self, first: SeqEvent, ids: list[int]) -> dict:
        lp = self.fmt.first_prompt(ids[0])
        rest = self.fmt.completion((first.prompt_logprobs or [])[1:], len(lp["tokens"][0]))
        return merge_completion_logprobs(lp, rest)

    @staticmethod
    def _echo_prefix(req: ChatRequest) -> str:
        """vLLM's chat `echo`: the reply is prefixed with the last message when that message is the assistant's
        (the turn being continued, e.g. with continue_final_message); otherwise nothing."""
        if not req.echo or not req.messages or req.messages[-1].role != "assistant":
            return ""
        content = req.messages[-1].content
        if isinstance(content, list):  # content parts: their text, in order
            return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
        return content or ""

    async def collect_chat(self, req: ChatRequest) -> dict:
        by_index = await self._collect()
        choices = []
        echo = self._echo_prefix(req)
        for i, evs in sorted(by_index.items()):
            lp = None
            if req.logprobs:
                lp = {"content": self.fmt.chat([x for e in evs for x in (e.logprobs or [])])}
            choices.append({"index": i, "message": {"role": "assistant",
                                                    "content": echo + "".join(e.text for e in evs)},
                            "logprobs": lp, "finish_reason": _reason(evs[-1])})
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.state.model_name,
                "choices": choices, "usage": self._usage(by_index, 1)}

    # ---------------------------------------------------------------------------------------------- streaming

    async def _stream(self, req, chunk_fn, first_fn=None):
        """SSE text of the response: `first_fn()` and `chunk_fn(ev)` give the `data:` lines (str) of the chunks;
        the lines of the events that arrived together go out in one write."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self._extra = {"usage": None} if include_usage else {}
        self._tpl = ChunkTemplate(self._chunk_head(), include_usage)
        last: dict[int, SeqEvent] = {}
        try:
            if first_fn is not None:
                for line in first_fn():
                    yield line
            async for evs in self.batches():
                if evs is None:
                    yield ": ping\n\n"
                    continue
                out, failed = [], False
                for ev in evs:
                    if ev.error:
                        log.error("request %s (stream) failed: %s", self.rid, ev.error)
                        out.append(_data({"error": APIError(500, ev.error, type_="server_error").body()["error"]}))
                        failed = True
                        break
                    last[ev.index] = ev
                    out += chunk_fn(ev)
                if out:
                    yield "".join(out)
                if failed:
                    break
            if include_usage:
                u = self._usage({i: [e] for i, e in last.items()}, getattr(self, "_n_prompts", 1))
                yield _data({**self._chunk_head(), "choices": [], "usage": u})
            yield "data: [DONE]\n\n"
        except ClientGone:
            self.abort()
        except Exception as e:  # noqa: BLE001 - after the 200 the stream itself must report and end properly
            self.abort()
            log.error("request %s (stream) failed: %r", self.rid, e)
            err = APIError(500, f"internal error in request {self.rid}: {e!r}", type_="server_error")
            yield _data({"error": err.body()["error"]}) + "data: [DONE]\n\n"
        except BaseException:
            self.abort()  # client gone (cancelled): free the slots now
            raise

    def _chunk_head(self) -> dict:
        obj = "chat.completion.chunk" if self.rid.startswith("chatcmpl") else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.state.model_name}

    def _line(self, choice: dict) -> str:
        """The `data:` line of a stream chunk with one choice (the general path; text-only chunks use _tpl)."""
        return _data({**self._chunk_head(), "choices": [choice], **self._extra})

    def stream_completion(self, req: CompletionRequest, prompts, id_lists):
        self._n_prompts = len(id_lists)
        offsets: dict[int, int] = {}

        def chunks(ev: SeqEvent) -> list[str]:
            k = ev.index // req.n
            first = ev.index not in offsets
            text, lp = ev.text, None
            if req.echo and first:
                text = self._prompt_text(prompts[k], id_lists[k]) + text
            if req.logprobs is None:
                offsets[ev.index] = 0
                if not text and ev.finish_reason is None:
                    return []
                return [self._tpl.completion(ev.index, text, _reason(ev))]
            lp = self._prompt_logprobs(ev, id_lists[k]) if (req.echo and first) else None
            start = offsets.get(ev.index, 0) + (sum(len(t) for t in lp["tokens"]) if lp else 0)
            gen = self.fmt.completion(ev.logprobs or [], start)
            lp = merge_completion_logprobs(lp, gen) if lp else gen
            offsets[ev.index] = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else start
            return [self._line({"index": ev.index, "text": text, "logprobs": lp, "finish_reason": _reason(ev)})]

        return self._stream(req, chunks)

    def stream_chat(self, req: ChatRequest):
        echo = self._echo_prefix(req)

        def first() -> list[str]:
            return [self._line({"index": i, "delta": {"role": "assistant", "content": echo}, "logprobs": None,
                                "finish_reason": None}) for i in range(req.n)]

        def chunks(ev: SeqEvent) -> list[str]:
            out = []
            if req.logprobs and ev.logprobs:
                out.append(self._line({"index": ev.index, "delta": {"content": ev.text},
                                       "logprobs": {"content": self.fmt.chat(ev.logprobs)}, "finish_reason": None}))
            elif ev.text:
                out.append(self._tpl.chat_delta(ev.index, ev.text))
            if ev.finish_reason is not None:
                out.append(self._tpl.chat_finish(ev.index, _reason(ev)))
            return out

        return self._stream(req, chunks, first)


class ClientGone(Exception):
    """The HTTP client disconnected before its request finished."""


def _reason(ev: SeqEvent) -> str | None:
    if ev.finish_reason in (None, "stop", "length"):
        return ev.finish_reason
    return "abort"


# ---------------------------------------------------------------------------------------------- startup
