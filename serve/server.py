"""`k3 serve`: the OpenAI-compatible HTTP front end (FastAPI + uvicorn) over the continuous-batching Engine.

Routes (serving.md 1.1): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize,
/detokenize. Every request is validated here (protocol.py) before it reaches the engine; engine events come back
through an asyncio queue per request (jobs.py: the engine thread hands a step's events over with one loop wake-up).
A client that disconnects aborts its sequences, which frees their KDA slot and latent pages at the engine's next
step.
A pure ASGI middleware enforces the API key (every route but /health, constant-time comparison) and the body size
limit (413), so neither depends on the route or on well-formed JSON.
Graceful shutdown (serving.md 5): the first SIGTERM/SIGINT starts draining: new requests (and /health) get 503
`draining`, in-flight ones finish for up to `shutdown_timeout_s`, then whatever is left is aborted and uvicorn exits;
a second signal exits at once. Streams send `: ping` SSE comments every `sse_ping_interval_s` without events.
An unexpected exception in a route becomes a 500 in OpenAI's shape, logged as one line with the request id, and the
connection stays usable (an exception escaping to uvicorn would make it close a kept-alive connection).
/openapi.json declares every request and response body from protocol.py's models; the routes still parse the raw
body themselves (protocol.parse), which is faster than FastAPI's own request-model parameters and errors.
"""

from __future__ import annotations

import errno
import gc
import hmac
import logging
import socket
import sys
import threading
import time
from pathlib import Path

from k3.model.config import ConfigError

from .config import ServeConfig, serve_dtype
from .engine import Engine
from .metrics import Metrics

SERVE_EXTRA = ("fastapi", "starlette", "uvicorn", "jinja2", "pydantic")  # top-level modules of `pip install k3[serve]`


class MissingServeExtra(ModuleNotFoundError, ConfigError):
    """A module of the serve extra is not installed. Still a ModuleNotFoundError (for `except ImportError`), and a
    ConfigError, so `k3 serve` prints its one-line message instead of a traceback."""


class ServeError(ConfigError):
    """`k3 serve` cannot start with these settings here (e.g. the port is taken); the message names the fix."""


try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.openapi.utils import get_openapi
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from fastapi.routing import APIRoute
    from pydantic.json_schema import models_json_schema
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect

    from .chat import ChatTemplate, tokenizer_info
    from .jobs import Job, ServerState, sse_response
    from .protocol import (
        REQUEST_MODELS,
        STREAM_MODELS,
        APIError,
        ChatCompletionChunk,
        ChatCompletionResponse,
        ChatRequest,
        CompletionChunk,
        CompletionRequest,
        CompletionResponse,
        DetokenizeRequest,
        DetokenizeResponse,
        ErrorResponse,
        HealthResponse,
        ModelList,
        TokenizeRequest,
        TokenizeResponse,
        TokenizerInfoResponse,
        context_error,
        new_id,
        parse,
        sampling_params,
    )
except ModuleNotFoundError as e:
    if (e.name or "").partition(".")[0] not in SERVE_EXTRA:
        raise
    raise MissingServeExtra(f"k3 serve needs the serve extra ({e.name} is not installed): pip install 'k3[serve]'",
                            name=e.name) from None

log = logging.getLogger("k3.serve")


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")  # the routes max_concurrent_per_key counts


class GuardMiddleware:
    """API key (401), per-key concurrency (429) and body size (413) checks at the ASGI level, before routing and
    JSON parsing. A request counts against its key's limit until its response (streams included) has been sent."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cfg = self.state.cfg
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        auth = headers.get("authorization", "")
        key = auth[7:].strip() if cfg.api_keys and auth[:7].lower() == "bearer " else ""  # "" = the shared bucket
        known = any(hmac.compare_digest(key.encode(), k.encode()) for k in cfg.api_keys)
        if cfg.api_keys and scope.get("path") != "/health" and not known:
            self.state.metrics.inc("k3:requests_rejected", reason="unauthorized")
            err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
            return await _error_response(err)(scope, receive, send)
        limited = cfg.max_concurrent_per_key > 0 and scope.get("path") in GENERATION_ROUTES
        if limited:
            if self.state.in_flight.get(key, 0) >= cfg.max_concurrent_per_key:
                self.state.metrics.inc("k3:requests_rejected", reason="rate_limited")
                err = APIError(429, f"this API key already has {cfg.max_concurrent_per_key} requests in flight "
                                    f"(max_concurrent_per_key); retry when one finishes", type_="rate_limit_error",
                               code="rate_limit_exceeded", headers={"Retry-After": "1"})
                return await _error_response(err)(scope, receive, send)
            self.state.in_flight[key] = self.state.in_flight.get(key, 0) + 1  # one event loop: no lock needed
        try:
            return await self._guarded(scope, receive, send, headers)
        except Exception:  # noqa: BLE001 - Starlette's outermost handler answered and logged it (internal_error),
            return None   # then re-raised; to uvicorn that would mean closing a kept-alive connection
        finally:
            if limited:
                self.state.in_flight[key] -= 1

    async def _guarded(self, scope, receive, send, headers):
        cfg = self.state.cfg
        limit = cfg.max_body_bytes
        too_large = APIError(413, f"request body exceeds the {limit}-byte limit (max_body_bytes)",
                             code="request_too_large")
        try:
            declared = int(headers.get("content-length", "0") or 0)
        except ValueError:
            declared = 0
        if declared > limit:
            return await _error_response(too_large)(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise APIError(413, too_large.message, code="request_too_large")
            return msg

        return await self.app(scope, limited_receive, send)


RID = "k3.request_id"  # the scope key a route stores its request id under (cmpl-..., chatcmpl-...)


def request_id(request: Request) -> str:
    rid = request.scope.get(RID)
    if rid is None:
        rid = request.scope[RID] = new_id("req")
    return rid


def internal_error(request: Request, exc: BaseException) -> JSONResponse:
    """500 for an exception no route expected: one log line naming the request, the same id in the body."""
    rid = request_id(request)
    log.error("request %s (%s %s) failed: %r", rid, request.method, request.url.path, exc)
    log.debug("request %s traceback", rid, exc_info=exc)
    return _error_response(APIError(500, f"internal error in request {rid}: {exc!r}", type_="server_error"))


class GuardedRoute(APIRoute):
    """A route whose unexpected exceptions become internal_error's 500 here, inside the route. Starlette's handler
    for Exception answers too, but then re-raises, and uvicorn closes a kept-alive connection after an exception."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, StarletteHTTPException):
                raise  # answered by their exception handlers
            except Exception as e:  # noqa: BLE001 - any other failure is this request's 500, not the server's
                return internal_error(request, e)

        return guarded


def _errors(*codes: int) -> dict:
    return {c: {"model": ErrorResponse, "description": "error in OpenAI's shape"} for c in codes}


def _ref(model) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _body(model) -> dict:
    """openapi_extra declaring `model` as the JSON request body (the route parses the raw body with it)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _ref(model)}}}}


def _sse(model, chunk) -> dict:
    """A 200 that is `model` as JSON, or with stream: true an SSE stream whose events (the schema describes one, as
    OpenAPI 3.1 reads it for text/event-stream) carry a `chunk`, an error after the stream started, or [DONE]."""
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json",
                       "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"const": "message"}}}
    return {200: {"model": model, "description": "the response; with stream: true, SSE events of chunks",
                  "content": {"text/event-stream": {"schema": event}}}}


class PrometheusResponse(PlainTextResponse):
    media_type = "text/plain; version=0.0.4"


def _openapi(app: FastAPI):
    """app.openapi: FastAPI's schema plus the request models the routes validate with (protocol.REQUEST_MODELS),
    which FastAPI cannot see because the routes read the raw body."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS]
                                         + [(m, "serialization") for m in STREAM_MODELS],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema
    return openapi


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application over `state` (the engine may be attached later)."""
    app = FastAPI(title="k3 serve", docs_url=None, redoc_url=None)
    app.router.route_class = GuardedRoute
    app.openapi = _openapi(app)
    cfg = state.cfg

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        if exc.status >= 500 and exc.status != 503:
            log.error("request %s (%s %s) failed: %s", request_id(request), request.method, request.url.path,
                      exc.message)
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                                        code=code))

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):  # outside a route (GuardedRoute catches the rest)
        return internal_error(request, exc)

    def engine() -> Engine:
        if state.draining:
            state.metrics.inc("k3:requests_rejected", reason="draining")
            raise APIError(503, "the server is shutting down and accepts no new requests; retry on another replica",
                           type_="unavailable_error", code="draining", headers={"Retry-After": "5"})
        eng = state.engine
        if eng is not None and eng.dead is not None:
            raise APIError(503, f"the engine stopped: {eng.dead!r}", type_="unavailable_error", code="engine_dead")
        if eng is None or not eng.ready:
            raise APIError(503, "the model is loading", type_="unavailable_error", code="loading",
                           headers={"Retry-After": "5"})
        return eng

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{state.model_name}'",
                           param="model", code="model_not_found")

    async def body(request: Request) -> bytes:
        try:
            return await request.body()
        except ClientDisconnect:  # gone during the upload: nobody reads the answer, so no error either
            log.debug("client disconnected while sending the body of %s %s", request.method, request.url.path)
            raise APIError(499, "client closed the request", code="client_closed_request") from None

    # ---------------------------------------------------------------------------------------------- plain routes

    @app.get("/health", responses={200: {"model": HealthResponse}, **_errors(503)})
    async def health():
        if state.load_error is not None:
            return _error_response(APIError(503, f"loading failed: {state.load_error}", type_="unavailable_error",
                                            code="load_failed"))
        engine()
        return {"status": "ok"}

    @app.get("/metrics", response_class=PrometheusResponse,
             responses={200: {"description": "Prometheus text exposition format 0.0.4 (serving.md 3)"}, **_errors(401)})
    async def metrics():
        return PrometheusResponse(state.metrics.render())

    @app.get("/v1/models", responses={200: {"model": ModelList}, **_errors(401, 500, 503)})
    async def models():
        eng = engine()
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "k3", "root": cfg.ckpt, "max_model_len": eng.max_model_len}]}

    @app.get("/tokenizer_info", responses={200: {"model": TokenizerInfoResponse}, **_errors(401, 500, 503)})
    async def get_tokenizer_info():
        """The tokenizer config (vLLM's /tokenizer_info): what lm-eval's remote tokenizer backend reads."""
        engine()
        return tokenizer_info(state.chat)

    @app.post("/tokenize", openapi_extra=_body(TokenizeRequest),
              responses={200: {"model": TokenizeResponse}, **_errors(400, 401, 404, 413, 500, 503)})
    async def tokenize(request: Request):
        eng = engine()
        req = parse(TokenizeRequest, await body(request))
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if req.messages is not None:
            ids = state.chat.render([m.model_dump() for m in req.messages],
                                    add_generation_prompt=req.add_generation_prompt,
                                    add_special_tokens=bool(req.add_special_tokens))
        else:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = eng.tok.encode(req.prompt, add_special_tokens=special)
        return {"tokens": ids, "count": len(ids), "max_model_len": eng.max_model_len}

    @app.post("/detokenize", openapi_extra=_body(DetokenizeRequest),
              responses={200: {"model": DetokenizeResponse}, **_errors(400, 401, 404, 413, 500, 503)})
    async def detokenize(request: Request):
        eng = engine()
        req = parse(DetokenizeRequest, await body(request))
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < eng.tok.vocab_size]
        if bad:
            raise APIError(400, f"token ids must lie in [0, {eng.tok.vocab_size}), got {bad[:5]}", param="tokens")
        return {"prompt": eng.tok.decode(req.tokens)}

    # ---------------------------------------------------------------------------------------------- generation

    def check_prompt(eng: Engine, ids: list[int], max_tokens: int | None, param: str, *, allow_zero=False) -> int:
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        V = eng.model.config.vocab_size
        if any(not 0 <= t < V for t in ids):
            raise APIError(400, f"prompt token ids must lie in [0, {V})", param=param)
        n_ctx = eng.max_model_len
        out = n_ctx - len(ids) if max_tokens is None else max_tokens
        if len(ids) + max(out, 1 if not allow_zero else 0) > n_ctx or (max_tokens is None and out < 1):
            raise context_error(len(ids), max(out, 1 if max_tokens is None else out), n_ctx, param)
        return out

    @app.post("/v1/completions", openapi_extra=_body(CompletionRequest),
              responses={**_sse(CompletionResponse, CompletionChunk), **_errors(400, 401, 404, 413, 429, 500, 503)})
    async def completions(request: Request):
        eng = engine()
        req = parse(CompletionRequest, await body(request))
        check_model(req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) or not prompts:
            prompts = [prompts]
        if len(prompts) * req.n > cfg.max_n * 4:
            raise APIError(400, f"too many prompts x n ({len(prompts)} x {req.n})", param="prompt")
        id_lists = [eng.tok.encode(p, add_special_tokens=req.add_special_tokens) if isinstance(p, str) else list(p)
                    for p in prompts]
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens=0 is only valid with echo=true (prompt scoring)", param="max_tokens")
        outs = [check_prompt(eng, ids, req.max_tokens, "prompt", allow_zero=req.echo) for ids in id_lists]
        lp = req.logprobs
        params = [sampling_params(req, max_tokens=o, logprobs=lp, prompt_logprobs=lp if (req.echo and lp is not None)
                                  else None, max_stop=cfg.max_stop, max_n=cfg.max_n, max_top_logprobs=cfg.max_top_logprobs)
                  for o in outs]
        rid = request.scope[RID] = new_id("cmpl")
        job = Job(state, request, rid)
        job.submit(id_lists, params, req.n)
        if req.stream:
            return sse_response(job.stream_completion(req, prompts, id_lists))
        return await job.collect_completion(req, prompts, id_lists)

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatRequest),
              responses={**_sse(ChatCompletionResponse, ChatCompletionChunk), **_errors(400, 401, 404, 413, 429, 500, 503)})
    async def chat(request: Request):
        eng = engine()
        req = parse(ChatRequest, await body(request))
        check_model(req.model)
        if not req.logprobs and req.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        ids = state.chat.render([m.model_dump() for m in req.messages], add_generation_prompt=req.add_generation_prompt,
                                continue_final_message=req.continue_final_message, kwargs=req.chat_template_kwargs,
                                add_special_tokens=req.add_special_tokens)
        mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        out = check_prompt(eng, ids, mt, "messages")
        params = sampling_params(req, max_tokens=out, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                 prompt_logprobs=None, max_stop=cfg.max_stop, max_n=cfg.max_n,
                                 max_top_logprobs=cfg.max_top_logprobs)
        rid = request.scope[RID] = new_id("chatcmpl")
        job = Job(state, request, rid)
        job.submit([ids], [params], req.n)
        if req.stream:
            return sse_response(job.stream_chat(req))
        return await job.collect_chat(req)

    return app


def load_state(cfg: ServeConfig, state: ServerState) -> None:
    """Load the checkpoint, build and warm the engine, start its thread. An error is raised, and its one-line form
    kept in state.load_error for /health."""
    import torch

    from k3.model.checkpoint import load_model
    from k3.model.tokenizer import K3Tokenizer
    from k3.model.transformer import count_parameters, describe_parameters

    t0 = time.monotonic()
    try:
        dev = cfg.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = serve_dtype(cfg.dtype, dev, cfg.ckpt)
        log.info("loading %s on %s", cfg.ckpt, dev)
        model, _ = load_model(cfg.ckpt, device=dev, dtype=dtype)
        tok = K3Tokenizer.from_file(cfg.ckpt)
        # the size line k3 pretrain prints for the same checkpoint (quantized experts counted as their weights)
        log.info("loaded %s (%s) in %.1f s; warming up%s", describe_parameters(count_parameters(model)),
                 next(model.parameters()).dtype, time.monotonic() - t0,
                 " (CUDA graphs%s)" % (", compiled: minutes" if cfg.compile_decode else "")
                 if dev.startswith("cuda") and cfg.cuda_graphs else "")
        attach_engine(state, Engine(model, tok, cfg, state.metrics), ChatTemplate(tok, cfg.ckpt), freeze=True)
        state.metrics.set("k3:time_to_ready_seconds", time.monotonic() - t0)
        log.info("ready in %.1f s: http://%s:%d/v1 (model %r)", time.monotonic() - t0, cfg.host, cfg.port,
                 state.model_name)
    except Exception as e:
        state.load_error = f"{type(e).__name__}: {e}"
        raise


def freeze_heap() -> None:
    """Move every object alive after start-up (modules, the model, the tokenizer, warm-up leftovers) to the garbage
    collector's permanent generation (gc.freeze, https://docs.python.org/3/library/gc.html#gc.freeze), so the full
    collections that serving triggers scan only what came after. A k3-debug server tracks ~335k objects (torch,
    FastAPI, uvicorn imported): a full collection took 157 ms (on 2 CPU cores), stalling the engine thread and every
    stream with it; 0.2 ms once frozen."""
    gc.collect()  # garbage found now is freed, not frozen
    gc.freeze()


def attach_engine(state: ServerState, engine: Engine, chat: ChatTemplate, freeze: bool = False) -> None:
    """Warm the engine (unless disabled), start its thread and publish it to the routes; `freeze`: freeze_heap after
    the warm-up (the process's start-up, as `k3 serve` does; tests that build many engines in one process do not)."""
    state.chat = chat
    if state.cfg.warmup:
        engine.warmup()
    else:
        engine.ready = True
    if freeze:
        freeze_heap()
    engine.start()
    state.engine = engine


def drain(state: ServerState, timeout_s: float, poll_s: float = 0.02) -> bool:
    """Graceful shutdown: refuse new requests (503 draining) and wait up to `timeout_s` for the engine to finish
    the in-flight ones; abort whatever is left after that. Returns True when everything finished in time."""
    state.draining = True
    eng = state.engine
    if eng is None or eng.dead is not None:
        return True
    deadline = time.monotonic() + timeout_s
    while eng.has_work():
        if time.monotonic() >= deadline:
            eng.abort_all()
            return False
        time.sleep(poll_s)
    return True


def make_server(app, state: ServerState, **uvicorn_kwargs):
    """A uvicorn server whose first SIGINT/SIGTERM drains (`drain`) before exiting; a second one exits at once."""

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if state.draining or self.should_exit:
                return super().handle_exit(sig, frame)
            state.draining = True  # set here, in the signal handler, so no request slips in after the signal

            def finish() -> None:
                drain(state, state.cfg.shutdown_timeout_s)
                self.should_exit = True

            threading.Thread(target=finish, name="k3-drain", daemon=True).start()

    return DrainingServer(uvicorn.Config(app, **uvicorn_kwargs))


def make_state(cfg: ServeConfig) -> ServerState:
    name = cfg.served_model_name or (Path(cfg.ckpt).resolve().name if cfg.ckpt else "k3")
    return ServerState(cfg=cfg, model_name=name, metrics=Metrics(name))


def _startup_log(level: str) -> None:
    """Progress lines of the k3.serve logger (loading, warm-up and graph captures, ready) on stderr, at INFO unless
    the uvicorn log level asks for less (error, critical)."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("k3 serve: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO if level.lower() in ("trace", "debug", "info", "warning") else logging.ERROR)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound as uvicorn binds it (SO_REUSEADDR), or ServeError naming the port and the fix.
    Bound before anything else starts: uvicorn's own bind failure calls sys.exit while the loading thread runs
    torch code, and the interpreter then aborts ("terminate called without an active exception", rc 134)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"port {port} on {host} is already in use; pass a free one with --port (or "
                             f"--set serve.port=N), or stop the process listening there") from None
        raise ServeError(f"cannot listen on {host}:{port} ({e.strerror or e}); pass another --host or --port") from None
    sock.set_inheritable(True)
    return sock


def run_server(cfg: ServeConfig) -> None:
    """Serve `cfg.ckpt` until interrupted: HTTP comes up at once (503 on /health), the model loads and warms in
    the background, then /health turns 200; SIGTERM drains (module docstring). Startup progress goes to stderr.
    If loading fails the server stops and the loading error is raised here, as `k3 generate` raises it."""
    _startup_log(cfg.log_level)
    if not Path(cfg.ckpt).is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {cfg.ckpt}; pass a release directory "
                                "(e.g. runs/<name>/final)")
    from k3.model.checkpoint import read_release_config

    read_release_config(cfg.ckpt)  # fail fast on a broken checkpoint; weights then load in the background
    sock = bind_socket(cfg.host, cfg.port)
    state = make_state(cfg)
    server = make_server(GuardMiddleware(build_app(state), state), state, host=cfg.host, port=cfg.port,
                         log_level=cfg.log_level, timeout_graceful_shutdown=max(1, round(cfg.shutdown_timeout_s)))
    failed: list[BaseException] = []

    def load() -> None:
        try:
            load_state(cfg, state)
        except BaseException as e:  # noqa: BLE001 - raised again on the main thread, after the server stopped
            failed.append(e)
            server.should_exit = True

    threading.Thread(target=load, name="k3-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if state.engine is not None:
            state.engine.stop()
    if failed:
        raise failed[0]


__all__ = [
    "GuardMiddleware",
    "MissingServeExtra",
    "Response",
    "ServeError",
    "ServerState",
    "attach_engine",
    "bind_socket",
    "build_app",
    "drain",
    "freeze_heap",
    "load_state",
    "make_server",
    "make_state",
    "run_server",
]
