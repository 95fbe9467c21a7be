"""rjax.loading.tokenizer against transformers' tokenizer built from the same files (the oracle).

Token ids, decode round trips and chat templates must equal what transformers produces for the
same GGUF file (and for the Hugging Face directory transformers saves from it). The oracle's
answers are cached on disk (`.cache/oracle/`), so after the first run no torch starts.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest

from rjax.loading.tokenizer import Tokenizer
from tests.oracle.client import oracle_random_qwen2, oracle_save_tokenizer, oracle_tokenize

pytestmark = pytest.mark.oracle

CORPUS = [
    "",
    "Hello world",
    "The capital of France is",
    " leading space",
    "trailing spaces   ",
    "two  spaces, three   spaces,    four",
    "tabs\tand\t\tdouble tabs",
    "newlines\nand\n\nblank lines\n\n\n",
    "\n leading newline",
    "mixed \t \n whitespace \r\n windows line end",
    "    ",
    "x  12 and y   345",
    "digits 0123456789 and a long number 3141592653589793238462643383279",
    "1,234,567.89 and -42 and 1e-10 and 0x1F",
    "numeric unicode: ½ ² ³ ① Ⅻ ٣",
    "Accents: café, naïve, São Paulo, Ærøskøbing, über",
    "CJK: 你好，世界。日本語のテキスト。한국어 텍스트",
    "Arabic: مرحبا بالعالم، كيف حالك؟",
    "Hebrew and Hindi: שלום עולם नमस्ते दुनिया",
    "Emoji: 😀 👍🏽 🇫🇷 ❤️ 🪿 𓀀",
    "ZWJ: 👨‍👩‍👧‍👦 and 🏳️‍🌈 and 👩🏽‍💻",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class A:\n\tdef f(self):\n\t\treturn {'a': [1, 2, 3]}  # comment\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end<|im_end|>",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>not at start <eos> <pad>",
    "<unk> literal and < | im_start | > broken",
    "I'm can't we'll they've you'd SHE'LL IT'S",
    "URL: https://example.com/path?q=1&r=two#frag, email a.b@c.org",
    "Symbols: ~!@#$%^&*()_+-={}[]|\\:;\"'<>,.?/ `backticks`",
    "ß→SS, İstanbul, ﬁ ligature, Ⅸ, ｆｕｌｌｗｉｄｔｈ",
    "\u200b zero width space and \u00a0 nbsp and \u3000 ideographic space",
    "A" * 50 + " " + "ab" * 30,
    "▁ literal sentencepiece marker ▁▁",
    "<0x41> literal byte token text",
]

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan? 🇯🇵"},
]

STREAM_TEXTS = [
    "Emoji 😀 then a family 👨‍👩‍👧‍👦 and a flag 🏳️‍🌈!",
    "rare ones byte by byte: 🪿 𓀀 Ꙭ 🫠🧌 done",
    "mixed 日本語 text ✨ with <|im_end|> and <end_of_turn> inside",
]

MODELS = ["smollm2", "gemma3"]


@lru_cache(maxsize=None)
def _gguf_tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(path))


@pytest.fixture(params=MODELS)
def model(request) -> tuple[str, Path, Tokenizer]:
    path = request.getfixturevalue(f"{request.param}_path")
    return request.param, path, _gguf_tokenizer(str(path))


def _show(tok: Tokenizer, ids) -> list:
    return [(i, tok.id_to_token(i)) for i in ids]


def _assert_same_tokenization(tok: Tokenizer, oracle: dict, texts: list[str]) -> None:
    for i, text in enumerate(texts):
        ids = tok.encode(text)
        assert ids == oracle["ids_with_special"][i], (
            f"default encode of {text!r}\n rjax   {_show(tok, ids)}\n oracle {_show(tok, oracle['ids_with_special'][i])}"
        )
        bare = tok.encode(text, add_bos=False)
        assert bare == oracle["ids_without_special"][i], (
            f"encode(add_bos=False) of {text!r}\n rjax   {_show(tok, bare)}\n"
            f" oracle {_show(tok, oracle['ids_without_special'][i])}"
        )


def _assert_same_decoding(tok: Tokenizer, oracle: dict) -> None:
    for i, ids in enumerate(oracle["ids_with_special"]):
        assert tok.decode(ids, skip_special=False) == oracle["decoded_with_special"][i]
        assert tok.decode(ids, skip_special=True) == oracle["decoded_skip_special"][i]
        assert tok.decode(ids) == oracle["decoded_skip_special"][i]  # skip_special is the default


# --- GGUF -------------------------------------------------------------------------------------


def test_encode_matches_transformers(model):
    name, path, tok = model
    _assert_same_tokenization(tok, oracle_tokenize(path, CORPUS, MESSAGES), CORPUS)


def test_decode_matches_transformers(model):
    name, path, tok = model
    oracle = oracle_tokenize(path, CORPUS, MESSAGES)
    _assert_same_decoding(tok, oracle)
    # Text without special tokens comes back unchanged from its ids (a literal "▁" is a space to
    # a sentencepiece vocabulary, so that text is left out).
    for text, ids in zip(CORPUS, oracle["ids_without_special"]):
        if "<" not in text and "▁" not in text:
            assert tok.decode(ids) == text


def test_special_ids_match_transformers(model):
    name, path, tok = model
    oracle = oracle_tokenize(path, CORPUS, MESSAGES)
    assert tok.bos_id == oracle["bos_token_id"]
    assert tok.eos_id == oracle["eos_token_id"]
    assert tok.vocab_size == oracle["vocab_size"]
    assert tok.add_bos == (oracle["ids_with_special"][1][:1] == [oracle["bos_token_id"]])
    assert tok.eos_id in tok.eos_ids
    end_of_turn = {"smollm2": "<|im_end|>", "gemma3": "<end_of_turn>"}[name]
    assert tok.token_to_id(end_of_turn) in tok.eos_ids
    # Ordinary text tokens never stop generation.
    assert not set(tok.encode("The capital of France is", add_bos=False)) & tok.eos_ids
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id


def test_smollm2_chat_template_matches_transformers(smollm2_path):
    tok = _gguf_tokenizer(str(smollm2_path))
    oracle = oracle_tokenize(smollm2_path, CORPUS, MESSAGES)
    assert oracle["chat_rendered"] is not None
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True) == oracle["chat_rendered"]
    assert tok.encode_chat(MESSAGES) == oracle["chat_ids"]
    # Without a system message the template inserts SmolLM's default one.
    rendered = tok.apply_chat_template(MESSAGES[1:2], add_generation_prompt=False)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_end|>\n")


def test_gemma3_base_model_has_no_chat_template(gemma3_path):
    """A base model's file carries no template, and none is made up for it (a guessed one makes
    it answer with garbage): rendering a conversation is refused with a message saying why."""
    tok = _gguf_tokenizer(str(gemma3_path))
    oracle = oracle_tokenize(gemma3_path, CORPUS, MESSAGES)
    assert oracle["chat_template"] is None and tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat(MESSAGES)


# --- streaming --------------------------------------------------------------------------------


def test_stream_decoder_emits_whole_characters(model):
    name, path, tok = model
    for text in STREAM_TEXTS:
        ids = tok.encode(text, add_bos=False)
        for skip_special in (True, False):
            dec = tok.stream_decoder(skip_special=skip_special)
            chunks = [dec.add(i) for i in ids]
            tail = dec.flush()
            assert "".join(chunks) + tail == tok.decode(ids, skip_special=skip_special)
            assert not any("\ufffd" in c for c in chunks), f"broken character streamed for {text!r}: {chunks}"
        # A rare emoji is several byte tokens in both vocabularies: the decoder must hold it back.
        assert "" in chunks or "rare" not in text


def test_stream_decoder_equals_decode_on_random_ids(model):
    name, path, tok = model
    rng = np.random.default_rng(0)
    byte_tokens = [tok.token_to_id(f"<0x{b:02X}>") for b in range(0x80, 0x100)]
    pool = [i for i in byte_tokens if i is not None] or list(range(100, 300))  # gemma: byte fallback ids
    for _ in range(20):
        ids = [int(i) for i in rng.integers(0, tok.vocab_size, size=int(rng.integers(1, 40)))]
        # splice in runs of high bytes so partial characters occur
        for _ in range(3):
            at = int(rng.integers(0, len(ids) + 1))
            ids[at:at] = [int(x) for x in rng.choice(pool, size=int(rng.integers(1, 4)))]
        for skip_special in (True, False):
            dec = tok.stream_decoder(skip_special=skip_special)
            streamed = dec.add_many(ids) + dec.flush()
            assert streamed == tok.decode(ids, skip_special=skip_special)


# --- Hugging Face directories -----------------------------------------------------------------


def test_hf_dir_matches_transformers(model):
    """The tokenizer transformers saves from the GGUF, loaded back by both sides."""
    name, path, gguf_tok = model
    directory = oracle_save_tokenizer(path)
    tok = Tokenizer.from_hf_dir(directory)
    oracle = oracle_tokenize(directory, CORPUS, MESSAGES)
    _assert_same_tokenization(tok, oracle, CORPUS)
    _assert_same_decoding(tok, oracle)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (oracle["bos_token_id"], oracle["eos_token_id"], oracle["vocab_size"])
    assert tok.add_bos == gguf_tok.add_bos
    if oracle["chat_rendered"] is not None:
        assert (directory / "chat_template.jinja").is_file()
        assert tok.apply_chat_template(MESSAGES) == oracle["chat_rendered"]
        assert tok.encode_chat(MESSAGES) == oracle["chat_ids"]


def test_hf_dir_random_qwen2_tokenizer():
    """A byte-level BPE with the Qwen2 split rule, EOS list in generation_config.json."""
    directory = oracle_random_qwen2(seed=0)
    tok = Tokenizer.from_hf_dir(directory)
    oracle = oracle_tokenize(directory, CORPUS, MESSAGES)
    _assert_same_tokenization(tok, oracle, CORPUS)
    _assert_same_decoding(tok, oracle)
    assert tok.vocab_size == oracle["vocab_size"]
    assert tok.bos_id is None and not tok.add_bos
    assert {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")} <= tok.eos_ids
    assert tok.apply_chat_template(MESSAGES) == oracle["chat_rendered"]
    assert tok.encode_chat(MESSAGES) == oracle["chat_ids"]


# --- errors -----------------------------------------------------------------------------------


def _tiny_gguf(path: Path, model: str, pre: str = "default") -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_types([1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.add_token_scores([0.0, 0.0, 0.0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unknown_tokenizer_model_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model 'bert'.*gpt2.*llama"):
        Tokenizer.from_gguf(gguf.GGUFReader(_tiny_gguf(tmp_path / "bert.gguf", "bert")))
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre 'mystery'.*supported"):
        Tokenizer.from_gguf(_tiny_gguf(tmp_path / "pre.gguf", "gpt2", pre="mystery"))


def test_tiny_gguf_byte_level_tokenizer(tmp_path):
    """A minimal file exercises the defaults: merges applied, no BOS/EOS metadata, no template."""
    tok = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "tiny.gguf", "gpt2"))
    assert tok.encode("abab") == [2, 2] and tok.encode("ba") == [1, 0]
    assert tok.bos_id is None and tok.eos_ids == frozenset() and not tok.add_bos
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_chat_template_environment_matches_hugging_face_conventions():
    """The helpers and whitespace rules Hugging Face templates rely on."""
    from rjax.loading.tokenizer import compile_chat_template

    source = (
        "{% for m in messages %}\n"
        "  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
        "  {% generation %}{{ m.content | tojson }}{% endgeneration %};\n"
        "{% endfor %}\n"
        "{{ strftime_now('%Y') | length }}"
    )
    out = compile_chat_template(source).render(messages=[{"role": "user", "content": "é<>"}, {"role": "skip"}])
    assert out == '"é<>";\n4'  # trim_blocks/lstrip_blocks, no HTML escaping, non-ASCII kept
    with pytest.raises(jinja2.exceptions.TemplateError, match="nope"):
        compile_chat_template("{{ raise_exception('nope') }}").render()
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_chat_template("{{ messages.append(1) }}").render(messages=[])
