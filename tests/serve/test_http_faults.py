"""HTTP-level faults (serving.md 1.5): a 500, however it arises (an exception in a route, an engine failure, an
exception inside a started stream), is answered in OpenAI's shape and logged as one line with the request id, and
the kept-alive connection stays usable; a client that drops while uploading the body is a debug line, not an error.
Responses are read from raw sockets, so a connection the server closed cannot be hidden by a client reconnecting."""

import contextlib
import json
import logging
import socket
import time

import pytest

from k3.serve import jobs


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def lines(self, level=logging.ERROR) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@contextlib.contextmanager
def capture(name: str, level=logging.DEBUG):
    """Records of logger `name` (a handler on it directly: k3 serve's logger may not propagate)."""
    logger, h = logging.getLogger(name), Records()
    old = logger.level
    logger.addHandler(h)
    logger.setLevel(level)
    try:
        yield h
    finally:
        logger.removeHandler(h)
        logger.setLevel(old)


class Conn:
    """One kept-alive HTTP/1.1 connection: request() sends, response() reads one whole response (Content-Length or
    chunked) and fails if the server closed the connection instead."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.buf = b""

    def request(self, method: str, path: str, body: dict | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        self.sock.sendall(head.encode() + data)

    def _read(self, n: int | None = None, until: bytes | None = None) -> bytes:
        while (until is not None and until not in self.buf) or (n is not None and len(self.buf) < n):
            chunk = self.sock.recv(65536)
            assert chunk, "the server closed the connection"
            self.buf += chunk
        if until is not None:
            out, _, self.buf = self.buf.partition(until)
            return out
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self) -> tuple[int, dict, bytes]:
        head = self._read(until=b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self._read(until=b"\r\n"), 16):
                body += self._read(size)
                self._read(2)
            self._read(2)
        else:
            body = self._read(int(headers.get("content-length", "0")))
        assert headers.get("connection", "").lower() != "close", headers
        return status, headers, body

    def close(self):
        self.sock.close()


@pytest.fixture
def live(server_factory):
    live = server_factory(warmup=False)
    yield live
    live.stop()


def test_unexpected_exception_is_a_logged_500_on_a_kept_alive_connection(live, monkeypatch):
    """An exception no route expected (here from the engine's submit) answers 500 server_error naming the request
    id, logs exactly one line with that id, and the same connection then serves the next request."""
    def boom(*a, **k):
        raise RuntimeError("injected submit failure")

    monkeypatch.setattr(live.engine, "submit", boom)
    conn = Conn(live.url)
    with capture("k3.serve") as log, capture("uvicorn.error") as uv:
        conn.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        status, _, body = conn.response()
        err = json.loads(body)["error"]
        assert status == 500 and err["type"] == "server_error" and "injected submit failure" in err["message"]
        rid = err["message"].split("request ")[1].split(":")[0]
        assert rid.startswith("cmpl-")
        errors = log.lines()
        assert len(errors) == 1 and rid in errors[0] and "\n" not in errors[0], errors
        conn.request("GET", "/health")
        assert conn.response()[0] == 200
        assert uv.lines() == []  # nothing escaped to uvicorn ("Exception in ASGI application")
    conn.close()


def _fail_engine(monkeypatch, engine):
    def broken(*a, **k):
        raise RuntimeError("injected engine failure")

    monkeypatch.setattr(engine.runner, "step", broken)


def test_engine_failure_is_a_logged_500_then_503_on_the_same_connection(live, monkeypatch):
    """The engine's step raises: the waiting request gets 500 (one log line with its id), the engine is dead, and
    the same connection gets the 503 engine_dead that follows."""
    _fail_engine(monkeypatch, live.engine)
    conn = Conn(live.url)
    with capture("k3.serve") as log:
        conn.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        status, _, body = conn.response()
        err = json.loads(body)["error"]
        assert status == 500 and "injected engine failure" in err["message"]
        errors = log.lines()
        assert len(errors) == 1 and "cmpl-" in errors[0] and "injected engine failure" in errors[0], errors
    conn.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    status, _, body = conn.response()
    assert status == 503 and json.loads(body)["error"]["code"] == "engine_dead"
    conn.close()


def test_failures_inside_a_stream_end_it_properly(live, monkeypatch):
    """After a stream's 200 the error goes in-band: an engine failure, and an exception in the stream's own code,
    each give `data: {"error": ...}` then `data: [DONE]`, a properly ended chunked body (the connection serves the
    next request) and one log line with the request id."""
    conn = Conn(live.url)
    stream = {"prompt": "def f(", "max_tokens": 4, "stream": True, "temperature": 0}

    def bad_chunk(*a, **k):
        raise RuntimeError("injected chunk failure")

    with monkeypatch.context() as mp, capture("k3.serve") as log:
        mp.setattr(jobs.ChunkTemplate, "completion", bad_chunk)
        conn.request("POST", "/v1/completions", stream)
        status, _, body = conn.response()
        events = [x for x in body.decode().split("\n\n") if x]
        assert status == 200 and events[-1] == "data: [DONE]", events
        assert "injected chunk failure" in json.loads(events[-2][6:])["error"]["message"]
        assert len(log.lines()) == 1 and "cmpl-" in log.lines()[0]
    conn.request("GET", "/health")
    assert conn.response()[0] == 200
    _fail_engine(monkeypatch, live.engine)
    with capture("k3.serve") as log:
        conn.request("POST", "/v1/completions", stream)
        status, _, body = conn.response()
        events = [x for x in body.decode().split("\n\n") if x]
        assert status == 200 and events[-1] == "data: [DONE]"
        assert "injected engine failure" in json.loads(events[-2][6:])["error"]["message"]
        assert len(log.lines()) == 1 and "cmpl-" in log.lines()[0]
    conn.request("GET", "/v1/models")
    assert conn.response()[0] == 503  # the engine is dead; the connection is not
    conn.close()


def test_client_gone_during_the_body_upload_is_quiet(live):
    """Half a body, then the socket closes: no ERROR line (uvicorn's "Exception in ASGI application ...
    ClientDisconnect" before), only k3's debug line; the server goes on serving."""
    with capture("k3.serve") as log, capture("uvicorn.error") as uv:
        s = socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1])))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": \"hal")
        time.sleep(0.2)  # the route is waiting for the rest of the body
        s.close()
        deadline = time.monotonic() + 10
        while not any("disconnected while sending the body" in m for m in log.lines(logging.DEBUG)):
            assert time.monotonic() < deadline, (log.lines(logging.DEBUG), uv.lines(logging.DEBUG))
            time.sleep(0.02)
        assert log.lines() == [] and uv.lines() == []
    conn = Conn(live.url)
    conn.request("POST", "/tokenize", {"prompt": "still here"})
    assert conn.response()[0] == 200
    conn.close()
