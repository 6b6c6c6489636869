"""OpenAI wire protocol: request models with range checks (serving.md 1.3), errors (1.5) and response shapes.

Requests are validated strictly (no type coercion but one: a whole-number float such as 4.0 is an integer, as in
JSON Schema and OpenAI's API; NaN/inf rejected; unknown informational fields ignored), so bad input becomes a 400
naming the field and never reaches the engine. Every string of the body, dictionary keys included, must be valid
Unicode: JSON's escapes can spell a lone UTF-16 surrogate ("\\ud800"), which no tokenizer or UTF-8 writer accepts,
so it is a 400 naming the field and the position. Fields that would change the output but are not supported yet
(`logit_bias`, `response_format`, `tools`, ...) are rejected with 400 and `param` set.

The response models below are what /openapi.json declares for each route; the routes build their responses as
dicts (the hot path) and the tests check the two agree.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from .request import SamplingParams, TokenLogprob

UNSUPPORTED = ("logit_bias", "response_format", "tools", "tool_choice", "functions", "function_call", "suffix",
               "guided_json", "guided_regex", "guided_choice", "guided_grammar")


class APIError(Exception):
    """An error answered in OpenAI's shape {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, extra: dict | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.extra, self.headers = extra or {}, headers or {}

    def body(self) -> dict:
        param = None if self.param is None else safe_text(self.param)
        return {"error": {"message": safe_text(self.message), "type": self.type, "param": param, "code": self.code,
                          **self.extra}}


def safe_text(s: str) -> str:
    """`s` with any lone surrogate written as its escape (backslash, u, hex), so a message quoting client input can
    always be encoded as UTF-8."""
    if s.isascii():
        return s
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _whole(v):
    """A whole-number float (4.0, 1e3) is an integer, as in JSON Schema and OpenAI's API; 4.5 stays invalid."""
    if type(v) is float and v.is_integer():
        return int(v)
    return v


Int = Annotated[int, BeforeValidator(_whole)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: Int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    seed: Int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # >= 0.01: dividing a logit by a denormal penalty (5e-324) overflows to inf, and softmax of inf is NaN
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: Int | None = Field(None, ge=0)
    best_of: Int | None = Field(None, ge=1)
    add_special_tokens: bool = Field(True, description="add the special tokens the tokenizer config asks for "
                                     "(BOS when tokenizer_config.json has add_bos_token: true) to string prompts")


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    echo: bool = False
    add_special_tokens: bool = Field(False, description="add the tokenizer config's special tokens on top of what "
                                     "the chat template writes (which already starts with BOS)")


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(None, description="as on the completion routes; default true with "
                                            "'prompt', false with 'messages'")
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Int]


MAX_DEPTH = 64  # nesting of arrays and objects in a request body; real requests need a handful


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """Bytes of a JSON body -> validated request, or APIError 400 naming the offending field."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    check_values(obj)
    for name in UNSUPPORTED:
        if obj.get(name) not in (None, {}, []):
            raise APIError(400, f"'{name}' is not supported by k3 serve yet; remove it from the request",
                           param=name, code="unsupported_parameter")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise APIError(400, f"invalid value for '{param}': {err['msg']}", param=param,
                       code="invalid_parameter") from None


def check_values(obj: dict) -> None:
    """Every value of a decoded body, at any depth: APIError 400 for a NaN or infinite number (json.loads accepts
    the literals), a string or key that is not valid Unicode (a lone surrogate from a "\\ud800" escape), or nesting
    deeper than MAX_DEPTH. Iterative, so no depth json.loads accepts can exhaust the stack here."""
    stack = [(obj, ())]
    while stack:
        v, path = stack.pop()
        if len(path) >= MAX_DEPTH:
            raise APIError(400, f"the request nests arrays and objects deeper than {MAX_DEPTH} levels",
                           param=_param(path[:1]), code="invalid_parameter")
        items = v.items() if type(v) is dict else enumerate(v)
        for k, x in items:
            if type(k) is str and not k.isascii():
                _check_unicode(k, path + (k,), "key")
            t = type(x)
            if t is str:
                if not x.isascii():
                    _check_unicode(x, path + (k,), "value")
            elif t is float:
                if not math.isfinite(x):
                    raise APIError(400, f"invalid value for '{_param(path + (k,))}': NaN and infinite numbers are "
                                        "not valid JSON values", param=_param(path + (k,)), code="invalid_parameter")
            elif t is dict or t is list:
                stack.append((x, path + (k,)))


def _param(path: tuple) -> str:
    return ".".join(str(x) for x in path)


def _check_unicode(s: str, path: tuple, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        param = _param(path)
        raise APIError(400, f"invalid {what} for '{param}': not valid Unicode: a lone UTF-16 surrogate "
                            f"U+{ord(s[e.start]):04X} at position {e.start}", param=param,
                       code="invalid_unicode") from None


GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: logits / 5e-324 overflow to inf (softmax NaN); this close to 0 is argmax


def sampling_params(req: _Sampling, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                    max_stop: int, max_n: int, max_top_logprobs: int) -> SamplingParams:
    """Validated request -> engine SamplingParams (range checks that depend on the server config)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > max_stop:
        raise APIError(400, f"at most {max_stop} stop sequences are allowed, got {len(stop)}", param="stop")
    if any(s == "" for s in stop):
        raise APIError(400, "stop sequences must be non-empty strings", param="stop")
    if req.n > max_n:
        raise APIError(400, f"n must be <= {max_n}, got {req.n}", param="n")
    for name, v in (("logprobs", logprobs), ("top_logprobs", prompt_logprobs)):
        if v is not None and v > max_top_logprobs:
            raise APIError(400, f"{name} must be <= {max_top_logprobs}, got {v}", param=name)
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    return SamplingParams(temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
                          top_k=max(0, req.top_k or 0), min_p=req.min_p or 0.0, max_tokens=max_tokens, stop=stop,
                          stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, seed=req.seed,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty, logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens)


def context_error(n_prompt: int, n_out: int, n_ctx: int, param: str = "prompt") -> APIError:
    """400 for prompt + output over the context, vLLM's wording plus llama-server's fields."""
    return APIError(400, f"This model's maximum context length is {n_ctx} tokens. However, you requested {n_out} "
                         f"output tokens and your prompt contains at least {n_prompt} input tokens, for a total of at "
                         f"least {n_prompt + n_out} tokens. Please reduce the length of the input prompt or the "
                         f"number of requested output tokens.", param=param,
                    code="context_length_exceeded", extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})


# ------------------------------------------------------------------------------------------------ responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class LogprobFormatter:
    """Token logprobs in the completions shape (tokens/token_logprobs/top_logprobs/text_offset) or the chat shape
    (content: [{token, logprob, bytes, top_logprobs}])."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def text(self, tid: int) -> str:
        return self.tok.token_bytes(tid).decode("utf-8", errors="replace")

    def completion(self, entries: list[TokenLogprob | None], offset0: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        off = offset0
        for e in entries:
            if e is None:
                continue
            s = self.text(e.token_id)
            out["tokens"].append(s)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({self.text(t): lp for t, lp in e.top} if e.top else None)
            out["text_offset"].append(off)
            off += len(s)
        return out

    def first_prompt(self, first_id: int, offset0: int = 0) -> dict:
        """The prompt's first token has no logprob (nothing predicts it): None, as OpenAI/vLLM report it."""
        return {"tokens": [self.text(first_id)], "token_logprobs": [None], "top_logprobs": [None],
                "text_offset": [offset0]}

    def chat(self, entries: list[TokenLogprob]) -> list[dict]:
        def one(tid, lp):
            s = self.text(tid)
            return {"token": s, "logprob": lp, "bytes": list(self.tok.token_bytes(tid))}
        return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def merge_completion_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


# ------------------------------------------------------------------------------------------------ response models
# What /openapi.json declares (serving.md 1); the routes answer plain dicts of the same shape.

FinishReason = Literal["stop", "length", "abort"] | None


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")  # context_length_exceeded adds n_prompt_tokens and n_ctx
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    """POST /v1/completions without stream; with stream the chunks have this shape, usage null or absent."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"]


class TokenizerInfoResponse(BaseModel):
    """GET /tokenizer_info: the checkpoint's tokenizer_config.json fields (vLLM's shape), added-token entries as
    their text, with the special tokens, add_bos_token and chat template the server applies."""
    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    bos_token: str
    eos_token: str
    pad_token: str
    add_bos_token: bool
    model_max_length: int
    chat_template: str


class CompletionChunk(BaseModel):
    """One SSE event's data of a completion stream; the usage chunk (stream_options.include_usage) has no choices."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


REQUEST_MODELS = (CompletionRequest, ChatRequest, TokenizeRequest, DetokenizeRequest)
STREAM_MODELS = (CompletionChunk, ChatCompletionChunk)  # what each SSE event's data holds (or an error, or [DONE])
