"""/openapi.json (serving.md 1.6): every request and response body declared from the pydantic models the server
validates with, /metrics as Prometheus text; and schemathesis, driven by that schema, against a live server: no 5xx
and no response that breaks the schema."""

import json
import subprocess
import sys

import httpx
import pytest

from k3.serve.protocol import REQUEST_MODELS

POST_BODIES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatRequest",
               "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}


@pytest.fixture(scope="module")
def schema(server):
    return httpx.get(server.url + "/openapi.json").json()


def _resolve(schema, ref):
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_every_request_body_is_declared(schema):
    """Each POST route declares its JSON body as the model protocol.parse validates it with (every field, the
    required ones required)."""
    models = {m.__name__: m for m in REQUEST_MODELS}
    for path, name in POST_BODIES.items():
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        declared = _resolve(schema, body["content"]["application/json"]["schema"]["$ref"])
        model = models[name]
        assert set(declared["properties"]) == set(model.model_fields), path
        assert set(declared.get("required", [])) == {k for k, f in model.model_fields.items() if f.is_required()}


def test_every_response_body_is_declared(schema, server):
    """Every operation declares a 200 body with a schema (JSON, or SSE events of chunks on the generation routes)
    and its errors in OpenAI's shape; /metrics is Prometheus text, as it answers."""
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            ok = op["responses"]["200"]["content"]
            if path == "/metrics":
                assert list(ok) == ["text/plain; version=0.0.4"], ok
                continue
            assert ok["application/json"]["schema"].get("$ref"), (method, path, ok)
            if path in ("/v1/completions", "/v1/chat/completions"):
                data = ok["text/event-stream"]["schema"]["properties"]["data"]
                assert data["anyOf"][1]["contentMediaType"] == "application/json"
            errors = [c for c in op["responses"] if c != "200"]
            assert errors, (method, path)
            for c in errors:
                assert op["responses"][c]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    r = httpx.get(server.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")


def test_responses_match_their_declared_models(server):
    """The dicts the routes build validate against the response models /openapi.json declares."""
    from k3.serve import protocol as p

    def get(path):
        return httpx.get(server.url + path).json()

    def post(path, body):
        r = httpx.post(server.url + path, json=body, timeout=60)
        return r.json()

    p.ModelList.model_validate(get("/v1/models"))
    p.HealthResponse.model_validate(get("/health"))
    p.TokenizerInfoResponse.model_validate(get("/tokenizer_info"))
    p.TokenizeResponse.model_validate(post("/tokenize", {"prompt": "x"}))
    p.DetokenizeResponse.model_validate(post("/detokenize", {"tokens": [5]}))
    p.CompletionResponse.model_validate(post("/v1/completions", {"prompt": "def", "max_tokens": 3, "echo": True,
                                                                 "logprobs": 2, "n": 2}))
    p.ChatCompletionResponse.model_validate(post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2}))
    p.ErrorResponse.model_validate(post("/v1/completions", {"prompt": "x" * 2000}))
    for path, body, chunk in (("/v1/completions", {"prompt": "def", "max_tokens": 3, "logprobs": 1}, p.CompletionChunk),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 3}, p.ChatCompletionChunk)):
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        for d in data[:-1]:
            chunk.model_validate(json.loads(d))


def test_schemathesis_finds_no_server_error_or_schema_violation(server_factory, tmp_path):
    """schemathesis run over /openapi.json (coverage phase: boundary and wrong-type values of every field; fuzzing:
    15 examples per operation; fixed seed) against a live server with a 32-token context so generations stay
    short: zero 5xx, zero responses breaking their schema, status code or content type. About 20 s on 2 cores."""
    live = server_factory(max_model_len=32, warmup=False)
    report = tmp_path / "report.json"
    try:
        checks = "not_a_server_error,response_schema_conformance,status_code_conformance,content_type_conformance"
        cmd = [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()", "run",
               live.url + "/openapi.json", "--checks", checks, "--phases", "coverage,fuzzing",
               "--max-examples", "15", "--seed", "1", "--workers", "1", "--request-timeout", "30",
               "--generation-database", "none", "--no-color", "--report", "json", "--report-json-path", str(report)]
        out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=110, check=False)
    finally:
        live.stop()
    assert report.is_file(), out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(report.read_text())
    cases = res["test_cases"]
    print(f"schemathesis: {res['operations']['tested']} operations, {cases['generated']} test cases, "
          f"{cases['with_failures']} with failures, {len(res['errors'])} errors in {res['running_time']:.1f} s")
    assert res["complete"] and res["operations"]["tested"] == res["operations"]["total"] >= 8
    assert cases["generated"] >= 200
    assert cases["with_failures"] == 0 and res["failures"] == [] and res["errors"] == [], out.stdout[-6000:]
    assert out.returncode == 0, out.stdout[-3000:]
