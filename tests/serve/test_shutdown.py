"""Server lifecycle (serving.md 1.2 and 5): graceful shutdown (the first SIGTERM makes new requests 503 `draining`
while in-flight ones finish, then the server exits; after `shutdown_timeout_s` leftovers are aborted and freed) and
SSE keep-alive `: ping` comments while a request waits. The engine is held at a gate so "in flight" and "waiting"
are states the test controls, not timing luck."""

import json
import signal
import threading
import time

import httpx

from k3.serve.server import drain


def _gate(engine) -> threading.Event:
    """Block the engine thread before each step while the returned event is clear."""
    gate = threading.Event()
    gate.set()
    step = engine.step

    def gated():
        gate.wait()
        return step()

    engine.step = gated
    return gate


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


class _Stream(threading.Thread):
    """A streaming completion read on a background thread: SSE lines, `first` set at the first data chunk."""

    def __init__(self, url, max_tokens):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.lines, self.status, self.first = [], None, threading.Event()

    def run(self):
        body = {"model": "k3-test", "prompt": "def main():", "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line:
                    self.lines.append(line)
                if line.startswith("data: "):
                    self.first.set()
        self.first.set()

    def chunks(self):
        return [json.loads(x[6:]) for x in self.lines if x.startswith("data: {")]


def _assert_draining_503(url):
    r = httpx.post(url + "/v1/completions", json={"model": "k3-test", "prompt": "x", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"]
    err = r.json()["error"]
    assert err["code"] == "draining" and err["type"] == "unavailable_error" and "shutting down" in err["message"]
    h = httpx.get(url + "/health", timeout=10)
    assert h.status_code == 503 and h.json()["error"]["code"] == "draining"


def test_sigterm_drains_then_exits(server_factory):
    live = server_factory(warmup=False)
    try:
        eng = live.engine
        gate = _gate(eng)
        s = _Stream(live.url, max_tokens=40)
        s.start()
        assert s.first.wait(30) and s.status == 200
        gate.clear()  # the request is now in flight and stays so until the gate opens
        live.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        _assert_draining_503(live.url)
        time.sleep(0.2)
        assert eng.has_work() and not live.server.should_exit  # still waiting for the in-flight request
        gate.set()
        s.join(30)
        chunks = s.chunks()
        assert s.lines[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 1
        _wait(lambda: live.server.should_exit)  # drained: uvicorn exits
        live.thread.join(10)
        assert not live.thread.is_alive()
        assert live.state.metrics.get("k3:requests_rejected", reason="draining") >= 1
        assert len(eng.states.free) == eng.states.num_slots and eng.pages.num_free == eng.pages.num_pages
    finally:
        live.stop()


def test_drain_timeout_aborts_and_frees(server_factory):
    live = server_factory(warmup=False)
    try:
        eng = live.engine
        gate = _gate(eng)
        s = _Stream(live.url, max_tokens=200)
        s.start()
        assert s.first.wait(30)
        gate.clear()
        assert drain(live.state, timeout_s=0.3) is False  # the request could not finish: aborted
        _assert_draining_503(live.url)
        gate.set()
        s.join(30)
        assert s.chunks()[-1]["choices"][0]["finish_reason"] == "abort" and s.lines[-1] == "data: [DONE]"
        _wait(lambda: not eng.has_work())
        assert len(eng.states.free) == eng.states.num_slots and eng.pages.num_free == eng.pages.num_pages
    finally:
        live.stop()


def test_sse_ping_while_waiting(server_factory):
    live = server_factory(warmup=False, sse_ping_interval_s=0.05)
    try:
        gate = _gate(live.engine)
        gate.clear()  # the request waits in the queue: no events, so the stream must ping
        body = {"model": "k3-test", "prompt": "def main():", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "stream": True}
        lines = []
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if sum(x == ": ping" for x in lines) == 3:
                    gate.set()
        data = [x for x in lines if x.startswith("data: ")]
        first_data = lines.index(data[0])
        assert lines[:first_data].count(": ping") >= 3  # pings came before any data
        assert all(x in ("", ": ping") or x.startswith("data: ") for x in lines)
        assert data[-1] == "data: [DONE]" and json.loads(data[-2][6:])["choices"][0]["finish_reason"] == "length"
    finally:
        live.stop()
