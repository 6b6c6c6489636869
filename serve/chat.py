"""Chat prompts: the checkpoint's own Jinja chat template (tokenizer_config.json["chat_template"]), sandboxed.

Rendered as Hugging Face's `apply_chat_template` does (variables `messages`, `bos_token`, `eos_token`,
`add_generation_prompt`, plus `chat_template_kwargs`), inside jinja2's ImmutableSandboxedEnvironment so a template
cannot reach Python internals. Without a template, k3's ChatML default (`K3Tokenizer.apply_chat_template`).
`tokenizer_info` is the tokenizer config as vLLM's /tokenizer_info serves it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from k3.model.tokenizer import CHAT_TEMPLATE, NO_MAX_LENGTH, K3Tokenizer

from .protocol import APIError


class ChatTemplate:
    """`render(messages, add_generation_prompt, continue_final_message, kwargs)` -> prompt token ids."""

    def __init__(self, tokenizer: K3Tokenizer, ckpt_dir: str | Path | None):
        self.tok = tokenizer
        self.config: dict = {}  # tokenizer_config.json, as read
        cfg_path = Path(ckpt_dir) / "tokenizer_config.json" if ckpt_dir else None
        if cfg_path is not None and cfg_path.is_file():
            self.config = json.loads(cfg_path.read_text(encoding="utf-8"))
        self.source = self.config.get("chat_template")
        self.template = None
        if isinstance(self.source, str):
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(self.source)

    def render_text(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: dict | None = None) -> str:
        """Prompt text for `messages` ([{role, content}]); content parts of type "text" are joined."""
        msgs = [{"role": m["role"], "content": _content_text(m.get("content"), i)} for i, m in enumerate(messages)]
        if continue_final_message:
            if msgs[-1]["role"] != "assistant":
                raise APIError(400, "continue_final_message needs the last message to be from the assistant",
                               param="continue_final_message")
            add_generation_prompt = False
        if self.template is None:
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
        else:
            try:
                text = self.template.render(messages=msgs, bos_token=self.tok.bos_token, eos_token=self.tok.eos_token,
                                            add_generation_prompt=add_generation_prompt, **(kwargs or {}))
            except jinja2.TemplateError as e:
                raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        if continue_final_message:  # drop the closing of the last turn so the model continues it
            last = msgs[-1]["content"]
            cut = text.rfind(last)
            if cut >= 0:
                text = text[:cut + len(last)]
        return text

    def render(self, messages: list[dict], *, add_special_tokens: bool = False, **kw) -> list[int]:
        """Prompt ids; add_special_tokens adds the tokenizer config's special tokens on top of the template's."""
        return self.tok.encode(self.render_text(messages, **kw), parse_special=True,
                               add_special_tokens=add_special_tokens)


def tokenizer_info(chat: ChatTemplate) -> dict:
    """vLLM's /tokenizer_info: the tokenizer config's fields (file names dropped, added tokens and special-token
    objects as their text) with the special tokens, add_bos_token and chat template this server applies."""
    tok = chat.tok
    info = {k: _token_text(v) for k, v in chat.config.items() if k not in ("vocab_file", "merges_file",
                                                                             "tokenizer_file")}
    if isinstance(info.get("added_tokens_decoder"), dict):
        info["added_tokens_decoder"] = {k: _token_text(v) for k, v in info["added_tokens_decoder"].items()}
    mml = info.get("model_max_length")
    info.update(tokenizer_class=info.get("tokenizer_class") or "PreTrainedTokenizerFast", bos_token=tok.bos_token,
                eos_token=tok.eos_token, pad_token=tok.pad_token, add_bos_token=tok.add_bos_token,
                model_max_length=mml if type(mml) is int else NO_MAX_LENGTH,
                chat_template=chat.source if isinstance(chat.source, str) else CHAT_TEMPLATE)
    return info


def _token_text(v):
    """A special token stored as {"content": str, ...} -> its text (what Hugging Face's AddedToken prints as)."""
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return v


def _content_text(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if p.get("type") != "text" or not isinstance(p.get("text"), str):
            raise APIError(400, f"messages[{i}].content: only text parts are supported, got {p.get('type')!r}",
                           param=f"messages.{i}.content")
        parts.append(p["text"])
    return "".join(parts)


def _raise(msg):
    raise jinja2.TemplateError(msg)
