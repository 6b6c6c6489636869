"""Property-based fuzz (hypothesis): malformed JSON and out-of-range or mistyped parameters never produce a 5xx,
and every error body has OpenAI's shape."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
