"""Chat prompts: the checkpoint's own Jinja chat template (tokenizer_config.json["chat_template"]), sandboxed.

Rendered as Hugging Face's `apply_chat_template` does (variables `messages`, `bos_token`, `eos_token`,
`add_generation_prompt`, plus `chat_template_kwargs`), inside jinja2's ImmutableSandboxedEnvironment so a template
cannot reach Python internals. Without a template, k3's ChatML default (`K3Tokenizer.apply_chat_template`).
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from k3.model.tokenizer import K3Tokenizer

from .protocol import APIError


class ChatTemplate:
    """`render(messages, add_generation_prompt, continue_final_message, kwargs)` -> prompt token ids."""

    def __init__(self, tokenizer: K3Tokenizer, ckpt_dir: str | Path | None):
        self.tok = tokenizer
        self.source = None
        cfg_path = Path(ckpt_dir) / "tokenizer_config.json" if ckpt_dir else None
        if cfg_path is not None and cfg_path.is_file():
            self.source = json.loads(cfg_path.read_text(encoding="utf-8")).get("chat_template")
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

    def render(self, messages: list[dict], **kw) -> list[int]:
        return self.tok.encode(self.render_text(messages, **kw), parse_special=True)


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
