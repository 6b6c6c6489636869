"""Fuzz of the request bodies: malformed JSON and out-of-range or mistyped parameters never produce a 5xx, and
every error body has OpenAI's shape. Property-based (hypothesis) over plausible bodies, plus a sweep that puts each
hostile value (lone surrogates, NULs, huge and negative numbers, wrong types, deep nesting) into every field of every
POST route, streamed and not: a lone surrogate is a 400 naming the field and the position."""

import json

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.serve.protocol import REQUEST_MODELS, APIError, ChatRequest, CompletionRequest, parse, sampling_params
from k3.serve.sampling import token_probs

ANY = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=True),
                st.text(max_size=8), st.lists(st.integers(-3, 600), max_size=4),
                st.lists(st.text(max_size=3), max_size=6), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def mix(valid):
    """Mostly plausible values (so many requests reach the engine), sometimes anything at all."""
    return st.one_of(*([valid] * 7), ANY)


SMALL_INT = st.integers(-2, 6)
FIELDS = {
    "model": mix(st.just("k3-test")), "temperature": mix(st.floats(-0.5, 2.5)), "top_p": mix(st.floats(-0.2, 1.2)),
    "top_k": mix(SMALL_INT), "min_p": mix(st.floats(-0.2, 1.2)), "n": mix(st.integers(0, 10)),
    "max_tokens": mix(SMALL_INT), "max_completion_tokens": mix(SMALL_INT),
    "stop": mix(st.one_of(st.text(max_size=2), st.lists(st.text(max_size=2), max_size=5))),
    "stop_token_ids": mix(st.lists(st.integers(-1, 600), max_size=3)), "seed": mix(st.integers(-(1 << 64), 1 << 64)),
    "logprobs": mix(st.one_of(st.booleans(), st.integers(-1, 25))), "top_logprobs": mix(st.integers(-1, 25)),
    "presence_penalty": mix(st.floats(-3, 3)), "frequency_penalty": mix(st.floats(-3, 3)),
    "repetition_penalty": mix(st.floats(-1, 3)), "echo": mix(st.booleans()), "stream": st.booleans(),
    "stream_options": mix(st.fixed_dictionaries({"include_usage": st.booleans()})), "logit_bias": ANY,
    "user": mix(st.text(max_size=5)), "ignore_eos": mix(st.booleans()),
}
PROMPT = mix(st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 700), max_size=6),
                       st.lists(st.text(max_size=5), min_size=1, max_size=3)))
MESSAGES = mix(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]),
                                               "content": mix(st.text(max_size=10))}), max_size=3))


def _check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and "type" in err and "code" in err


def _body(draw, path):
    keys = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=5, unique=True))
    body = {k: draw(FIELDS[k]) for k in keys}
    if draw(st.integers(0, 4)):
        if path == "/detokenize":
            body["tokens"] = draw(mix(st.lists(st.integers(-2, 600), max_size=5)))
        elif path in ("/v1/completions", "/tokenize") and draw(st.booleans()):
            body["prompt"] = draw(PROMPT)
        else:
            body["messages"] = draw(MESSAGES)
    return body


@st.composite
def requests_(draw):
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]))
    return path, _body(draw, path)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def short(server_factory):
    """A server with a 64-token context, so an omitted max_tokens (the rest of the context) ends soon."""
    live = server_factory(max_model_len=64, warmup=False)
    with httpx.Client(base_url=live.url, timeout=60) as c:
        c.live = live
        yield c
    live.stop()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=requests_())
def test_fuzzed_bodies_never_5xx(http, req):
    path, body = req
    try:
        raw = json.dumps(body, allow_nan=True)
    except ValueError:
        return
    _check(http.post(path, content=raw, headers={"content-type": "application/json"}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode)),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]))
def test_malformed_json_never_5xx(http, raw, path):
    r = http.post(path, content=raw)
    _check(r)


# ------------------------------------------------------------------------------------------------ the field sweep

BASES = {  # a valid body per route, small enough that the accepted mutations finish at once
    "/v1/completions": {"model": "k3-test", "prompt": "def f(", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"model": "k3-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                             "temperature": 0},
    "/tokenize": {"model": "k3-test", "prompt": "def f("},
    "/detokenize": {"model": "k3-test", "tokens": [5, 6]},
}
MODELS = dict(zip(BASES, REQUEST_MODELS, strict=True))
NESTED = {  # fields inside fields: (route, path)
    "/v1/completions": [("prompt", 0), ("stop", 0), ("stream_options", "include_usage")],
    "/v1/chat/completions": [("messages", 0, "content"), ("messages", 0, "role"), ("messages", 0, "name"),
                             ("messages", 0, "content", 0, "text"), ("chat_template_kwargs", "x")],
    "/tokenize": [("messages", 0, "content")],
    "/detokenize": [("tokens", 0)],
}
SURROGATE = "ab\ud800cd"  # json.dumps writes it as the escape "\\ud800", which json.loads turns back into it
HOSTILE = [SURROGATE, "\udfff", "a\x00b", "\x00", "", 10**30, -10**30, -1, 0, 4.5, 1e308, -1e308, 5e-324, True,
           None, [], {}, [SURROGATE], {"k": SURROGATE}, ["a"] * 3, "x" * 20000]


def _deep(depth: int):
    v: list = []
    for _ in range(depth):
        v = [v]
    return v


def _set(body: dict, path: tuple, value) -> dict:
    """A copy of body with `value` at `path` (lists and dicts created as needed)."""
    body = json.loads(json.dumps(body))
    node = body
    for i, k in enumerate(path[:-1]):
        nxt = path[i + 1]
        empty = [] if isinstance(nxt, int) else {}
        if isinstance(k, int):
            if not isinstance(node, list):
                return body
            while len(node) <= k:
                node.append(empty)
            if not isinstance(node[k], (list, dict)):
                node[k] = empty
        elif not isinstance(node.get(k), (list, dict)) or isinstance(node.get(k), list) != isinstance(empty, list):
            node[k] = empty if not (k == "messages" or k == "content") else ([{"role": "user", "content": "hi"}]
                                                                             if k == "messages" else [{}])
        node = node[k]
    if isinstance(path[-1], int):
        if not isinstance(node, list):
            return body
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value
    return body


def _cases():
    for route in BASES:
        paths = [(f,) for f in MODELS[route].model_fields] + NESTED[route]
        for path in paths:
            for value in [*HOSTILE, _deep(70)]:
                yield route, path, value


def _post(http, route, body) -> httpx.Response:
    return http.post(route, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def test_every_field_of_every_route_survives_hostile_values(short):
    """Each hostile value in each field (top-level and nested) of each POST route, and each completion request
    again with stream: true: never a 5xx, never an error inside a 200 stream, errors in OpenAI's shape; a lone
    surrogate anywhere is a 400 naming the field and its position."""
    seen = 0
    for route, path, value in _cases():
        body = _set(BASES[route], path, value)
        for stream in ((False, True) if route.startswith("/v1/") else (False,)):
            if stream:
                body = {**body, "stream": True}
            r = _post(short, route, body)
            seen += 1
            _check(r)
            if r.status_code == 200 and stream:
                assert '"error"' not in r.text, (route, path, value, r.text[:300])
            if (bad := _surrogate(body)) is not None:
                err = r.json()["error"]
                assert r.status_code == 400 and err["code"] == "invalid_unicode", (route, path, r.text[:300])
                assert err["param"] == bad[0] and f"at position {bad[1]}" in err["message"], (bad, err)
    assert seen > 1500 and short.live.engine.dead is None


def _surrogate(obj, path=()):
    """(dotted path, position) of the lone surrogate in a body, or None."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if isinstance(v, str):
            pos = next((i for i, c in enumerate(v) if 0xD800 <= ord(c) < 0xE000), None)
            if pos is not None:
                return ".".join(str(x) for x in (*path, k)), pos
        elif (found := _surrogate(v, (*path, k))) is not None:
            return found
    return None


def test_surrogates_in_keys_model_and_lists_are_400s(http):
    """A surrogate in a key, in `model` (once a 500 writing the 404 message), in a prompt list and in chat content
    parts: 400 naming the field; the escaped key is what the error quotes."""
    cases = [("/v1/completions", {"prompt": "x", "\ud800k": 1}, "\\ud800k"),
             ("/v1/completions", {"prompt": "x", "model": "m\ud800"}, "model"),
             ("/v1/completions", {"prompt": ["ok", "a\udc00"]}, "prompt.1"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
              "messages.0.content.0.text"),
             ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
             ("/detokenize", {"tokens": [1], "model": "\udbff"}, "model")]
    for route, body, param in cases:
        r = _post(http, route, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, r.text)
        assert "position" in r.json()["error"]["message"]


def test_deep_nesting_is_a_400(http):
    for depth in (70, 100_000):  # past MAX_DEPTH; past json.loads' own recursion limit
        raw = b'{"prompt": "x", "k": ' + b"[" * depth + b"]" * depth + b"}"
        r = http.post("/v1/completions", content=raw)
        assert r.status_code == 400, (depth, r.text[:200])


def test_whole_number_floats_are_integers(http):
    """n: 2.0, max_tokens: 5.0, top_k: 3.0, seed: 7.0, logprobs: 1.0 and 1e1 token ids are accepted as JSON Schema
    and OpenAI's API read them (integers), with the same output as the ints; 4.5 stays a 400 naming the field."""
    ints = {"prompt": [10, 11], "n": 2, "max_tokens": 5, "top_k": 3, "seed": 7, "logprobs": 1,
            "stop_token_ids": [3], "temperature": 0.7}
    floats = {"prompt": [1e1, 11.0], "n": 2.0, "max_tokens": 5.0, "top_k": 3.0, "seed": 7.0, "logprobs": 1.0,
              "stop_token_ids": [3.0], "temperature": 0.7}
    a, b = _post(http, "/v1/completions", ints), _post(http, "/v1/completions", floats)
    assert a.status_code == b.status_code == 200, b.text
    assert [c["text"] for c in a.json()["choices"]] == [c["text"] for c in b.json()["choices"]]
    chat = _post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3.0,
                                                 "max_completion_tokens": 2.0, "top_logprobs": 2.0, "logprobs": True})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 2
    assert _post(http, "/detokenize", {"tokens": [5.0, 6.0]}).json() == _post(http, "/detokenize",
                                                                              {"tokens": [5, 6]}).json()
    for field in ("n", "max_tokens", "top_k", "seed", "logprobs"):
        r = _post(http, "/v1/completions", {"prompt": "x", field: 4.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    r = _post(http, "/v1/completions", {"prompt": "x", "n": True})
    assert r.status_code == 400  # a bool is not an integer


def test_denormal_sampling_parameters_do_not_kill_the_engine(server, http):
    """5e-324 (the smallest float, a schemathesis boundary value): temperature is greedy (below vLLM's 1e-5),
    top_p keeps the top token, repetition_penalty is a 400 (dividing by it overflowed to inf); each of these used to
    stop the engine for every later request."""
    greedy = _post(http, "/v1/completions", {"prompt": "def f(", "max_tokens": 4, "temperature": 0}).json()
    for extra in ({"temperature": 5e-324}, {"temperature": 1.0, "top_p": 5e-324}):
        r = _post(http, "/v1/completions", {"prompt": "def f(", "max_tokens": 4, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
    r = _post(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, "repetition_penalty": 5e-324})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"
    assert server.engine.dead is None
    assert _post(http, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_sampling_guards_in_isolation():
    """The fixes below the server: a top_p that rounds to 0 in float32 keeps the top token; a tiny temperature
    becomes greedy in the engine's parameters."""
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    w = token_probs(logits, temperature=1.0, top_p=5e-324)
    assert w[0, 1] > 0 and w[0, 0] == w[0, 2] == 0
    req = parse(CompletionRequest, b'{"prompt": "x", "temperature": 1e-9}')
    assert sampling_params(req, max_tokens=1, logprobs=None, prompt_logprobs=None, max_stop=4, max_n=8,
                           max_top_logprobs=20).temperature == 0.0
    with pytest.raises(APIError, match="repetition_penalty"):
        parse(ChatRequest, b'{"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1e-3}')
