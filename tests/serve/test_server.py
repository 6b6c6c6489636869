"""HTTP API through the official `openai` client and a raw SSE parser (serving.md sections 1, 5, 6)."""

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
import torch

MODEL = "k3-test"


def _sse(url, body, headers=None):
    """POST a streaming request; check the SSE framing; return the decoded JSON events (without [DONE])."""
    events, lines = [], []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        for line in r.iter_lines():
            if not line or line.startswith(":"):
                continue
            assert line.startswith("data: "), line
            lines.append(line[6:])
    assert lines[-1] == "[DONE]" and "[DONE]" not in lines[:-1]
    for x in lines[:-1]:
        events.append(json.loads(x))
    return events


def test_health_models_and_loading(server, client):
    assert server.health_before_load == 503  # served before the engine was attached
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    card = client.models.list().data[0]
    assert card.id == MODEL and card.owned_by == "k3" and card.model_extra["max_model_len"] == 512


def test_completion_greedy_matches_engine_and_usage(server, client, model_tok):
    from k3.serve.generate import generate_tokens

    model, tok = model_tok
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    ids = tok.encode("def add(a, b):")  # add_special_tokens (default true) adds no BOS: add_bos_token is false
    ref = list(generate_tokens(model, ids, max_tokens=12, temperature=0))
    assert r.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == len(ids) + 12 and r.usage.prompt_tokens_details.cached_tokens == 0
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})  # token-id prompt
    assert r2.choices[0].text == r.choices[0].text


def test_echo_logprobs_score_the_prompt(server, client, model_tok):
    """Loglikelihood scoring (lm-eval style): echo + logprobs + max_tokens=0 -> per-token prompt logprobs."""
    model, tok = model_tok
    ids = tok.encode("import os\nprint(os.getcwd())", add_bos=True)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert len(lp.top_logprobs[i]) == 2
    assert r.choices[0].text == tok.decode(ids)
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_n_stop_and_logprobs(server, client):
    msgs = [{"role": "user", "content": "Write a function."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=1.0, n=3, seed=1,
                                       logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    for c in r.choices:
        assert c.message.role == "assistant"
        for e in c.logprobs.content:
            assert e.logprob <= 0 and len(e.top_logprobs) == 3
    g = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0,
                                       extra_body={"ignore_eos": True})
    text = g.choices[0].message.content
    stop = text[4:6]
    s = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True})
    assert s.choices[0].message.content == text[:text.find(stop)] and s.choices[0].finish_reason == "stop"


def test_chat_stream_format_and_usage(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 15, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    ev = _sse(server.url + "/v1/chat/completions", body)
    assert len({e["id"] for e in ev}) == 1 and len({e["created"] for e in ev}) == 1
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in ev)
    usage = [e for e in ev if e["usage"] is not None]
    assert len(usage) == 1 and usage[0] is ev[-1] and ev[-1]["choices"] == []
    assert ev[-1]["usage"]["completion_tokens"] == 15
    assert ev[-2]["choices"][0]["delta"] == {} and ev[-2]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in ev[1:-1])
    body.update(stream=False)
    full = httpx.post(server.url + "/v1/chat/completions", json=body).json()
    assert streamed == full["choices"][0]["message"]["content"]


def test_completion_stream_with_openai_client(server, client):
    chunks = list(client.completions.create(model=MODEL, prompt="x = ", max_tokens=8, temperature=0, stream=True,
                                            n=2, extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts[0] == texts[1] and texts[0]  # greedy: both choices agree
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason == "length") == 2


def test_32_concurrent_streams_complete(server):
    async def one(ac, i):
        body = {"model": MODEL, "prompt": f"# task {i}\n", "max_tokens": 6 + i % 5, "stream": True,
                "temperature": 0.7, "seed": i, "ignore_eos": True}
        n_tok, done = 0, False
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    n_tok += 1
        return done, n_tok

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(32)))

    res = asyncio.run(main())
    assert all(done for done, _ in res) and all(n >= 1 for _, n in res)
    _wait_idle(server)


def _wait_idle(server, timeout=20):
    deadline = time.time() + timeout
    eng = server.engine
    while eng.running or eng.waiting:
        assert time.time() < deadline, "engine did not drain"
        time.sleep(0.05)
    return eng


def test_disconnect_frees_slot_and_pages(server):
    eng = _wait_idle(server)
    body = {"model": MODEL, "prompt": "a" * 50, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                n += 1
            if n == 3:
                break  # leave after three chunks; closing the response drops the connection
    eng = _wait_idle(server)
    assert len(eng.states.free) == eng.states.num_slots and eng.pages.usage() == 0.0
    assert server.state.metrics.get("k3:num_requests_running") == 0
    assert server.state.metrics.get("k3:request_success", finished_reason="abort") >= 1


def test_errors_are_openai_shaped(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512 tokens.*501 output tokens"):
        client.completions.create(model=MODEL, prompt="x" * 20, max_tokens=501)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=3)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"})
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 2000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["n_ctx"] == 512
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (4 * 1024 * 1024 + 10))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(server.url + "/v2/unknown")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x", "temperature": NaN}')
    assert r.status_code == 400


def test_tokenize_detokenize_and_metrics(server, model_tok):
    _, tok = model_tok
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"])
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == "hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    text = httpx.get(server.url + "/metrics").text
    for name in ("k3:num_requests_running", "k3:kv_cache_usage_perc", "k3:time_to_first_token_seconds_bucket",
                 "k3:inter_token_latency_seconds_count", "k3:e2e_request_latency_seconds_sum",
                 "k3:prefix_cache_queries_total", "k3:prefix_cache_hits_total",
                 "k3:spec_decode_num_accepted_tokens_total", "k3:generation_tokens_total"):
        assert name in text, name
    assert 'model_name="k3-test"' in text


def test_api_key_and_queue_full(server_factory):
    live = server_factory(api_keys=["sekret"], max_queue=0, warmup=False)
    try:
        from openai import OpenAI

        bad = OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.post(live.url + "/tokenize", json={"prompt": "x"}).status_code == 401
        assert httpx.get(live.url + "/metrics").status_code == 401
        assert httpx.get(live.url + "/health").status_code == 200  # no key needed
        good = OpenAI(base_url=live.url + "/v1", api_key="sekret", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full" and "retry-after" in r.headers
    finally:
        live.stop()


def test_per_key_concurrency_limit_answers_429(server_factory):
    """max_concurrent_per_key=1: a key with a stream in flight gets 429 rate_limit_error with Retry-After (OpenAI's
    client raises RateLimitError); another key is unaffected; the slot frees when the stream ends."""
    live = server_factory(api_keys=["k1", "k2"], max_concurrent_per_key=1, warmup=False)
    try:
        from openai import OpenAI

        # 4 choices x 400 tokens: seconds of engine work, so the stream is still in flight during the checks below
        # (half the 8 slots, so the other key's request is scheduled at once)
        body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 400, "n": 4, "ignore_eos": True, "stream": True}
        h1, h2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, headers=h1, timeout=60) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # the stream is running
            r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                           headers=h1)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            with pytest.raises(openai.RateLimitError):
                OpenAI(base_url=live.url + "/v1", api_key="k1", max_retries=0).chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
            ok = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                            headers=h2)
            assert ok.status_code == 200
            assert httpx.get(live.url + "/v1/models", headers=h1).status_code == 200  # not a generation route
            for _ in lines:
                pass
        r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                       headers=h1)
        assert r.status_code == 200
        text = httpx.get(live.url + "/metrics", headers=h1).text
        assert re.search(r'k3:requests_rejected_total\{[^}]*reason="rate_limited"[^}]*\} 2\b', text), text
    finally:
        live.stop()


def test_chat_echo_prefixes_the_continued_assistant_turn(server, client):
    """echo=true (vLLM's chat semantics): with the last message from the assistant (continued via
    continue_final_message) the reply starts with that message, streamed or not; a user-final conversation is
    unchanged by echo."""
    msgs = [{"role": "user", "content": "Write a function."}, {"role": "assistant", "content": "def add(a, b):"}]
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                           extra_body={"continue_final_message": True, "add_generation_prompt": False})
    echoed = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, extra_body=extra)
    assert echoed.choices[0].message.content == "def add(a, b):" + plain.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                            extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == echoed.choices[0].message.content
    user_final = [{"role": "user", "content": "hi"}]
    a = client.chat.completions.create(model=MODEL, messages=user_final, max_tokens=4, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=user_final, max_tokens=4, temperature=0,
                                       extra_body={"echo": True})
    assert a.choices[0].message.content == b.choices[0].message.content
