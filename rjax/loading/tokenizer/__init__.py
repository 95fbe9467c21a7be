"""Tokenizer and chat template, built from GGUF metadata or a Hugging Face checkpoint directory.

The text <-> ids work is done by the `tokenizers` library; this package only assembles a
`tokenizers.Tokenizer` from what a GGUF file stores (`tokenizer.ggml.*`), adds BOS/EOS handling,
chat templates (jinja2, sandboxed, with the helpers Hugging Face templates expect) and an
incremental decoder for streaming.

The GGUF assembly follows what transformers builds from the same file, because transformers is
the reference the tests compare against. Where transformers and llama.cpp differ, transformers
wins (see `gguf_vocab._BYTE_LEVEL_SPLITS` for the one difference that shows on real text).

Modules: `core` (the `Tokenizer`: construction from either source, encode/decode, chat),
`gguf_vocab` (a `tokenizers` backend from a GGUF file's vocabulary), `chat_template` (the jinja2
environment), `stream` (incremental detokenization).
"""

from rjax.loading.tokenizer.chat_template import ChatTemplateError, compile_chat_template
from rjax.loading.tokenizer.core import Tokenizer
from rjax.loading.tokenizer.gguf_vocab import (SUPPORTED_GGUF_MODELS, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL,
                                               TOKEN_UNKNOWN, TOKEN_UNUSED, TOKEN_USER_DEFINED, byte_alphabet)
from rjax.loading.tokenizer.stream import StreamDecoder

__all__ = [
    "ChatTemplateError", "SUPPORTED_GGUF_MODELS", "StreamDecoder",
    "TOKEN_BYTE", "TOKEN_CONTROL", "TOKEN_NORMAL", "TOKEN_UNKNOWN", "TOKEN_UNUSED", "TOKEN_USER_DEFINED",
    "Tokenizer", "byte_alphabet", "compile_chat_template",
]
