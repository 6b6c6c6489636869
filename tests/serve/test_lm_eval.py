"""lm-evaluation-harness against `k3 serve` (serving.md 1.3, 1.7): its `local-completions` loglikelihood requests
as it sends them with tokenized_requests=False, its remote tokenizer backend (/tokenizer_info, /tokenize,
/detokenize, vLLM's shapes), and add_special_tokens with the echo and logprob offsets it implies. lm-eval itself
is not installed: the requests and the slicing are reproduced from lm_eval/models/openai_completions.py,
lm_eval/models/api_models.py and lm_eval/utils.py (RemoteTokenizer)."""

import json
import shutil

import httpx
import pytest
import torch

from k3.model.tokenizer import K3Tokenizer

MODEL = "k3-test"


class RemoteTokenizer:
    """What lm-eval's RemoteTokenizer sends: encode without special tokens, decode, the info fields."""

    def __init__(self, url: str):
        self.url = url
        self.info = httpx.get(url + "/tokenizer_info").raise_for_status().json()

    def encode(self, text: str) -> list[int]:
        return httpx.post(self.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    def decode(self, ids: list[int]) -> str:
        return httpx.post(self.url + "/detokenize", json={"tokens": ids}).json()["prompt"]

    @property
    def prefix_token_id(self) -> int:  # TemplateAPI.prefix_token_id: bos (or eos), encoded
        return self.encode(self.info["bos_token"] or self.info["eos_token"])[0]


def _loglikelihood(url, tok: RemoteTokenizer, context: str, continuation: str, max_tokens: int) -> tuple[float, list]:
    """One lm-eval loglikelihood request with tokenized_requests=False: context and continuation tokenized by the
    remote tokenizer (an empty context is the prefix token), the tokens decoded back into one string prompt, the
    payload of LocalCompletionsAPI._create_payload(generate=False) (no add_special_tokens field: the server's default
    applies), and parse_logprobs' slice: [ctxlen:-1] (the -1 drops the one generated token; with max_tokens=0 there
    is none, so [ctxlen:])."""
    ctx = tok.encode(context) if context else [tok.prefix_token_id]
    cont = tok.encode(continuation)
    prompt = tok.decode(ctx + cont)
    payload = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
               "seed": 1234, "echo": True}
    out = httpx.post(url + "/v1/completions", json=payload, timeout=60).raise_for_status().json()
    lps = out["choices"][0]["logprobs"]["token_logprobs"]
    part = lps[len(ctx):-1] if max_tokens else lps[len(ctx):]
    return sum(part), ctx + cont


def _model_loglikelihood(model, ids: list[int], ctxlen: int) -> float:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    return sum(lp[i - 1, ids[i]].item() for i in range(ctxlen, len(ids)))


@pytest.mark.parametrize("max_tokens", [1, 0])  # lm-eval sends 1; 0 is the scoring-only form
def test_lm_eval_loglikelihood_equals_the_models(server, model_tok, max_tokens):
    """The continuation's summed logprob as lm-eval computes it from k3's answer equals K3Model's own within 1e-4
    (the first two were 4.7 and 6.3 nats off while k3 prepended a BOS to string prompts, which lm-eval's context
    length does not count)."""
    model, k3tok = model_tok
    tok = RemoteTokenizer(server.url)
    for context, continuation in (("def add(a, b):\n    return", " a + b"), ("The answer is", " 42"),
                                  ("", "import os")):
        got, ids = _loglikelihood(server.url, tok, context, continuation, max_tokens)
        ctxlen = len(tok.encode(context)) if context else 1
        if context:
            assert k3tok.encode(context + continuation) == ids  # the string prompt re-tokenizes to lm-eval's tokens
        want = _model_loglikelihood(model, ids, ctxlen)
        assert got == pytest.approx(want, abs=1e-4), (context, continuation, got, want)


def test_tokenizer_info_is_what_lm_eval_reads(server, ckpt):
    """/tokenizer_info in vLLM's shape (the tokenizer config's fields): lm-eval's check_remote_tokenizer_support
    needs eos_token, its RemoteTokenizer bos/eos/pad and the chat template (rendered by lm-eval itself)."""
    info = httpx.get(server.url + "/tokenizer_info").json()
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert info["tokenizer_class"] == cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<|endoftext|>", "<|endoftext|>", "<|pad|>")
    assert info["add_bos_token"] is False and info["model_max_length"] == cfg["model_max_length"]
    assert info["chat_template"] == cfg["chat_template"]
    assert info["added_tokens_decoder"]["2"] == "<|im_start|>"  # entries as their text, as vLLM serves them
    import jinja2  # lm-eval renders the template itself: it must give the server's own chat prompt

    msgs = [{"role": "user", "content": "hi"}]
    text = jinja2.Environment().from_string(info["chat_template"]).render(
        messages=msgs, add_generation_prompt=True, bos_token=info["bos_token"])
    served = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    assert httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()[
        "tokens"] == served


def test_echo_text_and_offsets_without_bos(server, client, model_tok):
    """The default (add_special_tokens true, the tokenizer config adds nothing): echo returns the prompt exactly,
    one logprob entry per prompt token, and each text_offset points at its token in the returned text."""
    _, tok = model_tok
    prompt = "x = [1, 2]\nprint(x)"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == prompt and r.usage.prompt_tokens == len(tok.encode(prompt))
    lp = c.logprobs
    assert len(lp.tokens) == len(tok.encode(prompt)) and lp.token_logprobs[0] is None
    for t, off in zip(lp.tokens, lp.text_offset, strict=True):
        assert c.text[off:off + len(t)] == t


@pytest.fixture(scope="module")
def bos_server(server_factory, ckpt, tmp_path_factory):
    """A server whose tokenizer config says add_bos_token: true (a copy of the checkpoint's tokenizer files)."""
    d = tmp_path_factory.mktemp("bos_tok")
    for name in ("tokenizer.json", "special_tokens_map.json", "config.json"):
        shutil.copy(ckpt / name, d / name)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    tok = K3Tokenizer.from_file(d)
    assert tok.add_bos_token
    live = server_factory(tok=tok, ckpt_dir=d, warmup=False)
    yield live
    live.stop()


def test_add_special_tokens_follows_the_tokenizer_config(bos_server, model_tok):
    """add_bos_token: true: string prompts get BOS by default (add_special_tokens true, as vLLM) and not with
    add_special_tokens false; echo then includes the BOS text, and the offsets still index the returned text;
    chat adds one only when asked (its template writes BOS already); /tokenize and /tokenizer_info agree."""
    _, tok = model_tok
    url = bos_server.url
    prompt = "def f():"
    ids = tok.encode(prompt)

    def complete(**extra):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, **extra}
        return httpx.post(url + "/v1/completions", json=body, timeout=60).json()

    on, off = complete(), complete(add_special_tokens=False)
    assert on["usage"]["prompt_tokens"] == len(ids) + 1 and off["usage"]["prompt_tokens"] == len(ids)
    text, lp = on["choices"][0]["text"], on["choices"][0]["logprobs"]
    assert text == tok.bos_token + prompt and lp["tokens"][0] == tok.bos_token and lp["token_logprobs"][0] is None
    for t, o in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[o:o + len(t)] == t
    assert off["choices"][0]["text"] == prompt
    # the same tokens are scored either way, each once conditioned on one more token (the BOS)
    assert len(lp["token_logprobs"]) == len(off["choices"][0]["logprobs"]["token_logprobs"]) + 1
    tokd = httpx.post(url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert tokd == [tok.bos_id, *ids]
    assert httpx.post(url + "/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()["tokens"] == ids
    assert httpx.get(url + "/tokenizer_info").json()["add_bos_token"] is True
    msgs = [{"role": "user", "content": "hi"}]

    def chat(**extra):
        body = {"model": MODEL, "messages": msgs, "max_tokens": 1, **extra}
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]["prompt_tokens"]

    assert chat(add_special_tokens=True) == chat() + 1
    n_chat = len(httpx.post(url + "/tokenize", json={"messages": msgs}).json()["tokens"])
    assert n_chat == chat()
