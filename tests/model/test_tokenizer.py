"""K3Tokenizer: byte-level round trips, incremental decoding, save/load, chat template, errors."""

import json
import sysconfig
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models

from k3.model.tokenizer import (
    CHAT_TEMPLATE,
    EOT,
    IM_END,
    IM_START,
    PAD,
    IncrementalDecoder,
    K3Tokenizer,
    TokenizerError,
    train_bpe,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
MULTIBYTE = "naïve café — 日本語のテキスト 🙂🚀 e\u0301 Ωμέγα Привет 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200d👩\u200d💻"


@pytest.fixture(scope="module")
def corpus():
    names = ["textwrap.py", "bisect.py", "colorsys.py", "keyword.py"]
    return [(STDLIB / n).read_text(encoding="utf-8") for n in names] + [MULTIBYTE] * 3


@pytest.fixture(scope="module")
def tok(corpus):
    return train_bpe(corpus, vocab_size=400)


def test_special_tokens_and_vocab(tok):
    assert [tok.backend.token_to_id(t) for t in (EOT, PAD, IM_START, IM_END)] == [0, 1, 2, 3]
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 0, 1)
    assert tok.vocab_size == 400
    # merges were learned: Python code compresses below one token per byte
    code = (STDLIB / "textwrap.py").read_text(encoding="utf-8")
    assert len(tok.encode(code)) < 0.6 * len(code.encode("utf-8"))


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_round_trip_arbitrary_unicode(tok, text):
    ids = tok.encode(text, parse_special=False)
    assert tok.decode(ids) == text
    # independent check of the byte table: the tokens' raw bytes concatenate to the UTF-8 encoding of the text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


@pytest.mark.parametrize("name", ["ast.py", "json/decoder.py", "this.py"])
def test_round_trip_python_code(tok, name):
    text = (STDLIB / name).read_text(encoding="utf-8")
    assert tok.decode(tok.encode(text)) == text


def test_every_single_byte_character_round_trips(tok):
    text = "".join(chr(c) for c in range(1, 0x800))
    assert tok.decode(tok.encode(text)) == text


def test_special_token_text_parsing(tok):
    text = f"a{EOT}b"
    assert EOT in text and tok.eos_id in tok.encode(text)
    plain = tok.encode(text, parse_special=False)
    assert tok.eos_id not in plain and tok.decode(plain) == text
    assert tok.encode("x", add_bos=True) == [tok.bos_id, *tok.encode("x")]
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == "ab"
    assert tok.encode_batch(["ab", text], parse_special=False) == [tok.encode("ab"), plain]


def _stream(tok, ids, **kw):
    dec = IncrementalDecoder(tok, **kw)
    deltas = [dec.add(i) for i in ids]
    return deltas, dec.flush()


@pytest.mark.parametrize("text", [MULTIBYTE, "🙂" * 7, "日本" + EOT + "語", "x = '€'\n" * 3])
def test_incremental_decoder_matches_full_decode(tok, text):
    ids = tok.encode(text)
    # a character split across tokens: at least one token is not valid UTF-8 on its own
    assert any(_not_utf8(tok.token_bytes(i)) for i in tok.encode(MULTIBYTE))
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == text
    assert tail == ""
    assert all("\ufffd" not in d for d in deltas)  # never printed half a character
    deltas, tail = _stream(tok, ids, skip_special_tokens=True)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True)


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_incremental_decoder_flushes_a_cut_character(tok):
    ids = tok.encode("🙂", parse_special=False)
    partial = [i for i in ids if _not_utf8(tok.token_bytes(i))][:1] or ids
    deltas, tail = _stream(tok, partial)
    assert "".join(deltas) + tail == tok.decode(partial)


def test_save_load_round_trip(tok, tmp_path):
    out = tok.save(tmp_path / "t", model_max_length=4096)
    assert sorted(p.name for p in out.iterdir()) == ["special_tokens_map.json", "tokenizer.json",
                                                     "tokenizer_config.json"]  # no temp files left
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == (EOT, EOT, PAD)
    assert cfg["model_max_length"] == 4096 and cfg["chat_template"] == CHAT_TEMPLATE
    assert cfg["add_bos_token"] is False  # what add_special_tokens=True adds, as Hugging Face reads it
    smap = json.loads((out / "special_tokens_map.json").read_text())
    assert smap["additional_special_tokens"] == [IM_START, IM_END]
    for src in (out, out / "tokenizer.json"):
        back = K3Tokenizer.from_file(src)
        assert back.hash() == tok.hash()
        assert (back.bos_id, back.eos_id, back.pad_id, back.vocab_size) == (tok.bos_id, tok.eos_id, tok.pad_id, 400)
        assert back.encode(MULTIBYTE) == tok.encode(MULTIBYTE)


def test_training_is_deterministic(corpus, tok):
    assert train_bpe(corpus, vocab_size=400).hash() == tok.hash()
    assert train_bpe(corpus, vocab_size=380).hash() != tok.hash()


MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "naïve 🙂\nmulti-line"}],
]


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_template_python_equals_jinja(tok, messages, gen):
    sandbox = pytest.importorskip("jinja2.sandbox")
    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders
    want = env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=gen, bos_token=EOT)
    got = tok.apply_chat_template(messages, add_generation_prompt=gen)
    assert got == want
    assert got.startswith(EOT + IM_START) and got.endswith(f"{IM_START}assistant\n" if gen else f"{IM_END}\n")
    ids = tok.encode(got)
    assert ids.count(2) == len(messages) + gen and ids.count(3) == len(messages)  # <|im_start|>=2, <|im_end|>=3


def test_chat_template_rejects_bad_messages(tok):
    with pytest.raises(TypeError, match="message 0"):
        tok.apply_chat_template([{"role": "user"}])


def test_vocab_too_small():
    with pytest.raises(ValueError, match="at least 260"):
        train_bpe(["abc"], vocab_size=100)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        K3Tokenizer.from_file(tmp_path / "nope.json")
    with pytest.raises(TokenizerError, match="not found"):
        K3Tokenizer.from_file(tmp_path)  # a directory without tokenizer.json
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        K3Tokenizer.from_file(bad)
    wordpiece = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    wordpiece.save(str(bad))
    with pytest.raises(TokenizerError, match="byte-level"):
        K3Tokenizer.from_file(bad)


def test_config_names_foreign_special_tokens(tok, tmp_path):
    out = tok.save(tmp_path / "t")
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["bos_token"] = {"content": IM_START}
    cfg["pad_token"] = "<|no-such-pad|>"  # absent: falls back to EOS
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    back = K3Tokenizer.from_file(out)
    assert (back.bos_id, back.eos_id, back.pad_id) == (2, 0, 0)
    cfg["eos_token"] = "<|missing|>"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="eos token '<\\|missing\\|>'"):
        K3Tokenizer.from_file(out)


def test_add_special_tokens_follows_the_config(tok, tmp_path):
    """encode(add_special_tokens=True) adds BOS only when tokenizer_config.json says add_bos_token: true (Hugging
    Face's meaning; k3 saves false); add_bos=True always adds it. A config that is not an object is refused."""
    out = tok.save(tmp_path / "t")
    plain = K3Tokenizer.from_file(out)
    assert plain.add_bos_token is False
    assert plain.encode("x", add_special_tokens=True) == plain.encode("x")
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    bos = K3Tokenizer.from_file(out)
    assert bos.add_bos_token is True
    assert bos.encode("x", add_special_tokens=True) == [bos.bos_id, *bos.encode("x")]
    assert bos.encode("x", add_special_tokens=True, add_bos=True) == [bos.bos_id, *bos.encode("x")]  # one BOS
    bos.save(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())["add_bos_token"] is True
    (out / "tokenizer_config.json").write_text("[]")
    with pytest.raises(TokenizerError, match="expected a JSON object"):
        K3Tokenizer.from_file(out)


def test_lone_surrogate_is_a_value_error_naming_the_position(tok):
    """A str with a lone UTF-16 surrogate (JSON's "\\ud800" escape) is not valid Unicode: the Rust tokenizer
    raises a bare TypeError; encode and encode_batch name the code point and its position instead."""
    with pytest.raises(ValueError, match="lone surrogate U\\+D800 at position 2"):
        tok.encode("ab\ud800c")
    with pytest.raises(ValueError, match="lone surrogate U\\+DC00 at position 0"):
        tok.encode_batch(["fine", "\udc00x"])
    assert tok.encode("a\x00b") == tok.encode("a\x00b", parse_special=False)  # NUL is valid text
