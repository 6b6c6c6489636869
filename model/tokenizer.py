"""K3Tokenizer: a byte-level BPE `tokenizers.Tokenizer` with k3's special tokens and a ChatML chat template.

- Byte-level BPE (GPT-2, Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", section 2.2):
  text is UTF-8 encoded and every byte is mapped to one printable character before BPE, so any string round-trips
  and no token is ever unknown. The trainer starts from the full 256-byte alphabet.
- Special tokens (ids 0-3 when trained here): `<|endoftext|>` separates documents and serves as BOS and EOS,
  `<|pad|>` pads, `<|im_start|>` / `<|im_end|>` frame chat turns (ChatML).
- Saved the Hugging Face way: tokenizer.json, tokenizer_config.json (PreTrainedTokenizerFast, a Jinja
  `chat_template` equal to `apply_chat_template`, `add_bos_token`), special_tokens_map.json; each file written
  atomically.
- `add_special_tokens=True` in `encode` means what it means in Hugging Face's tokenizers: add what the tokenizer
  config says, i.e. BOS when `add_bos_token` is true. k3 saves `add_bos_token: false` (tokenizer.json has no
  post-processor, so Hugging Face's tokenizer adds nothing either); `add_bos=True` prepends BOS regardless.
- `IncrementalDecoder` turns a stream of ids into text deltas without emitting half a UTF-8 character: it joins the
  raw bytes of each token and decodes them with Python's incremental UTF-8 decoder, which holds back an incomplete
  trailing sequence until the next byte arrives.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOT, PAD, IM_START, IM_END)
# Hugging Face's "no limit" value for model_max_length (transformers' VERY_LARGE_INTEGER).
NO_MAX_LENGTH = int(1e30)

# ChatML: "<|im_start|>{role}\n{content}<|im_end|>\n" per message (OpenAI ChatML, as used by Qwen and others),
# preceded by BOS because every training document is preceded by <|endoftext|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatml(messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The ChatML turns of `messages` without BOS: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then
    "<|im_start|>assistant\n" if add_generation_prompt (apply_chat_template prepends BOS; training data's
    documents already follow an <|endoftext|>)."""
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"message {i} must be a dict with string 'role' and 'content', got {m!r}")
        parts.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable or unusable; the message names the file and the fix."""


def _check_unicode(text: str) -> None:
    """ValueError naming the first lone UTF-16 surrogate of `text` (JSON's "\\ud800" escape can produce one): the
    Rust tokenizer refuses such a str with a bare TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at position "
                         f"{e.start}") from None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the one the ByteLevel pre-tokenizer applies).

    Printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') map to themselves; the other 68 bytes map, in byte
    order, to code points 256, 257, ... (GPT-2 encoder.py, `bytes_to_unicode`).
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_CHAR_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` via a temp file in the same folder and os.replace, so readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _token_name(value) -> str | None:
    """tokenizer_config.json stores a special token as a string or as {"content": str, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class K3Tokenizer:
    """Byte-level BPE tokenizer with BOS/EOS `<|endoftext|>`, PAD `<|pad|>` and a ChatML template.

    Example:
        >>> tok = train_bpe(["def f(x):\\n    return x\\n"] * 10, vocab_size=300)
        >>> tok.decode(tok.encode("héllo 🙂")) == "héllo 🙂"
        True
    """

    def __init__(self, tokenizer: Tokenizer, *, bos_token: str = EOT, eos_token: str = EOT, pad_token: str = PAD,
                 add_bos_token: bool = False, source: str = "<memory>"):
        if not isinstance(tokenizer.decoder, decoders.ByteLevel):
            raise TokenizerError(f"{source}: k3 needs a byte-level BPE tokenizer (decoder ByteLevel), this one has "
                                 f"{type(tokenizer.decoder).__name__}; train one with k3 (leave data.tokenizer unset)")
        self._tok = tokenizer
        self._plain: Tokenizer | None = None  # copy that treats special-token text as plain text
        self.source = source
        ids = {}
        for role, name in (("bos", bos_token), ("eos", eos_token)):
            ids[role] = tokenizer.token_to_id(name)
            if ids[role] is None:
                raise TokenizerError(f"{source}: {role} token {name!r} is not in the vocabulary; add it as a special "
                                     f"token or train a tokenizer with k3 (leave data.tokenizer unset)")
        pad_id = tokenizer.token_to_id(pad_token)
        if pad_id is None:  # foreign tokenizers often lack a pad token; padding with EOS is the common fallback
            pad_token, pad_id = eos_token, ids["eos"]
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], pad_id
        self.add_bos_token = bool(add_bos_token)  # what encode(add_special_tokens=True) adds
        self._id_bytes: list[bytes] | None = None
        self._special_ids: frozenset[int] = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)

    # ---- construction

    @classmethod
    def from_file(cls, path_or_dir: str | os.PathLike) -> K3Tokenizer:
        """Load tokenizer.json (a file, or a directory holding it; tokenizer_config.json beside it names bos/eos/pad).

        Example: `K3Tokenizer.from_file("runs/x/final")`.
        """
        p = Path(path_or_dir).expanduser()
        path = p / "tokenizer.json" if p.is_dir() else p
        if not path.is_file():
            raise TokenizerError(f"{path}: tokenizer file not found; pass a tokenizer.json or the directory holding "
                                 f"it (e.g. a k3 checkpoint directory), or unset data.tokenizer to train one")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust loader raises a bare Exception for bad JSON or an unknown schema
            raise TokenizerError(f"{path}: not a valid tokenizer.json ({e}); re-create it with k3 or "
                                 f"`tokenizers`, or unset data.tokenizer to train a new one") from e
        names = {"bos_token": EOT, "eos_token": EOT, "pad_token": PAD}
        add_bos = False  # Hugging Face's default for a tokenizer.json without a BOS post-processor
        cfg_path = path.parent / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise TokenizerError(f"{cfg_path}: unreadable ({e}); fix or delete it") from e
            if not isinstance(cfg, dict):
                raise TokenizerError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}; fix or delete it")
            names = {key: _token_name(cfg.get(key)) or default for key, default in names.items()}
            add_bos = cfg.get("add_bos_token", False) is True
        return cls(tok, **names, add_bos_token=add_bos, source=str(path))

    # ---- properties

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the model's embedding needs at least this many rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tok

    def hash(self) -> str:
        """sha256 hex of tokenizer.json's content in canonical form (sorted keys), stable across save/load."""
        canon = json.dumps(json.loads(self._tok.to_str()), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canon.encode("utf-8")).hexdigest()

    # ---- encode / decode

    def _backend(self, parse_special: bool) -> Tokenizer:
        if parse_special:
            return self._tok
        if self._plain is None:
            self._plain = Tokenizer.from_str(self._tok.to_str())
            self._plain.encode_special_tokens = True
        return self._plain

    def encode(self, text: str, *, add_bos: bool = False, parse_special: bool = True,
               add_special_tokens: bool = False) -> list[int]:
        """Text -> ids [N]. parse_special=True turns "<|im_start|>" etc. in `text` into their special ids (needed
        for chat prompts); False encodes them as plain text (training documents). add_bos prepends `bos_id`, as
        every training document is preceded by it; add_special_tokens prepends it only when the tokenizer config
        says so (`add_bos_token`), as Hugging Face's tokenizers do. Text that is not valid Unicode (a lone UTF-16
        surrogate) raises ValueError naming its position.

        Example: `tok.encode("def f():")` -> `[..]`.
        """
        try:
            ids = self._backend(parse_special).encode(text, add_special_tokens=False).ids
        except TypeError:
            if isinstance(text, str):
                _check_unicode(text)
            raise
        return [self.bos_id, *ids] if add_bos or (add_special_tokens and self.add_bos_token) else ids

    def encode_batch(self, texts: Sequence[str], *, parse_special: bool = True) -> list[list[int]]:
        """Many texts -> list of id lists, tokenized in parallel by the Rust backend."""
        texts = list(texts)
        try:
            encs = self._backend(parse_special).encode_batch_fast(texts, add_special_tokens=False)
        except TypeError:
            for t in texts:
                if isinstance(t, str):
                    _check_unicode(t)
            raise
        return [e.ids for e in encs]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """ids [N] -> text. Invalid UTF-8 (e.g. a cut multi-byte character) decodes to U+FFFD."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a special token: its text in UTF-8)."""
        if self._id_bytes is None:
            table = []
            for i in range(self.vocab_size):
                tok = self._tok.id_to_token(i)
                if tok is None:  # a hole in the id space (possible in foreign tokenizer.json files)
                    table.append(b"")
                elif i in self._special_ids or any(c not in _CHAR_TO_BYTE for c in tok):
                    table.append(tok.encode("utf-8"))  # added tokens are stored as plain text
                else:
                    table.append(bytes(_CHAR_TO_BYTE[c] for c in tok))
            self._id_bytes = table
        if not 0 <= token_id < len(self._id_bytes):
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {len(self._id_bytes)})")
        return self._id_bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        """True for special tokens (removed by skip_special_tokens)."""
        return token_id in self._special_ids

    # ---- chat

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """ChatML prompt text: BOS, then "<|im_start|>{role}\\n{content}<|im_end|>\\n" per message, then
        "<|im_start|>assistant\\n" if add_generation_prompt. Equal to rendering `CHAT_TEMPLATE` with Jinja.

        Example: `tok.apply_chat_template([{"role": "user", "content": "hi"}])`
        -> "<|endoftext|><|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n".
        """
        for name in (IM_START, IM_END):
            if self._tok.token_to_id(name) is None:
                raise TokenizerError(f"{self.source}: chat needs the special token {name!r}, which this tokenizer "
                                     f"lacks; use a tokenizer trained by k3")
        return self.bos_token + chatml(messages, add_generation_prompt)

    # ---- save

    def save(self, directory: str | os.PathLike, *, model_max_length: int | None = None) -> Path:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory` (created),
        each atomically. Returns the directory. model_max_length None writes Hugging Face's "no limit" value.
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        extra = [t for t in (IM_START, IM_END) if self._tok.token_to_id(t) is not None]
        special_map = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
                       "additional_special_tokens": extra}
        added = {str(i): {"content": t.content, "special": t.special, "lstrip": t.lstrip, "rstrip": t.rstrip,
                          "normalized": t.normalized, "single_word": t.single_word}
                 for i, t in sorted(self._tok.get_added_tokens_decoder().items())}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special_map, "unk_token": None,
                  "add_bos_token": self.add_bos_token,
                  "model_max_length": NO_MAX_LENGTH if model_max_length is None else int(model_max_length),
                  "clean_up_tokenization_spaces": False, "added_tokens_decoder": added}
        if len(extra) == 2:
            config["chat_template"] = CHAT_TEMPLATE
        _atomic_write(d / "tokenizer.json", self._tok.to_str(pretty=True))
        _atomic_write(d / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        _atomic_write(d / "special_tokens_map.json", json.dumps(special_map, indent=2, ensure_ascii=False) + "\n")
        return d


def train_bpe(texts: Iterable[str], vocab_size: int, *, show_progress: bool = False) -> K3Tokenizer:
    """Train a byte-level BPE with k3's special tokens on `texts`; `vocab_size` counts specials and the 256 bytes.

    The result may hold fewer than `vocab_size` ids when the text has too few distinct pairs to merge.
    Example: `train_bpe(open("a.txt").read().split("\\n\\n"), vocab_size=4096)`.
    """
    minimum = 256 + len(SPECIAL_TOKENS)
    if int(vocab_size) < minimum:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE: it needs at least {minimum} "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens); set data.vocab_size >= {minimum}")
    tok = Tokenizer(models.BPE())
    # use_regex keeps GPT-2's split (words, numbers, punctuation runs, whitespace) so merges never cross them.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress)
    tok.train_from_iterator(texts, trainer)
    return K3Tokenizer(tok)


class IncrementalDecoder:
    """Streams ids to text: `add(id)` returns the newly printable text, never half a UTF-8 character.

    Concatenating every `add` result and `flush()` equals `tokenizer.decode(ids, skip_special_tokens)`.
    Example:
        >>> dec = IncrementalDecoder(tok)
        >>> text = "".join(dec.add(i) for i in tok.encode("日本")) + dec.flush()
    """

    def __init__(self, tokenizer: K3Tokenizer, *, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Feed one id; return the text that became complete (possibly "")."""
        token_id = int(token_id)
        if self.skip_special_tokens and self.tokenizer.is_special(token_id):
            return ""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: return what is left (an incomplete trailing character becomes U+FFFD)."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out
