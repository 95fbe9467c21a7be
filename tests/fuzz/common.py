"""What the fuzzers of every format share: chat templates good and hostile, the byte-level
vocabulary the GGUF and Hugging Face fixtures both carry, and the integer and byte values that
break parsers."""
from __future__ import annotations

import random

from rjax.loading.tokenizer import byte_alphabet


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] "
                  "+ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}"
                  "{% endif %}")
PROBE_TEXT = "Hello the world, <|im_end|> <end_of_turn> \u00fcn\u00ef 12  ok"
PROBE_MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROBE_TEXT},
                  {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
# Chat templates as a hostile model file might carry them: syntax errors, sandbox escapes, values
# and output past the size limits, deep recursion, failures at one message. (A render that runs
# past its time is tested on its own: here it would cost seconds a case.)
HOSTILE_TEMPLATES = [
    "{% for m in messages %}{{ m['content'] }", "{% if %}", "{{ messages }", "{% endfor %}", "{% raw %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ cycler.__init__.__globals__.os }}",
    "{{ messages.append(1) }}", "{{ 'a' * 10 ** 10 }}", "{{ ('x' * 1000000) | replace('x', 'yyyyyyyyyy') }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "{{ 'a' | center(10 ** 9) }}",
    "{{ '%1000000000d' % 1 }}", "{{ '{:>1000000000}'.format(1) }}", "{{ (['x' * 1000000] * 1000) | join }}",
    "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "{{ undefined_thing.attr }}", "{{ messages[99] }}",
    "{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no') }}{% endif %}{% endfor %}",
    "{{ messages[0].content + 1 }}", "{{ 10 ** 10 ** 10 }}", "{{" + "(" * 3000 + "1" + ")" * 3000 + "}}",
    "{{ strftime_now('%Y') }}{{ messages | tojson }}", "", "\u00e9\ud800", CHATML[:-7],
]


def hostile_template(rng: random.Random) -> str:
    """One of HOSTILE_TEMPLATES, or a working template with characters cut or inserted."""
    if rng.random() < 0.6:
        return rng.choice(HOSTILE_TEMPLATES)
    text = list(rng.choice([CHATML, GEMMA_TEMPLATE]))
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(text))
        if rng.random() < 0.5:
            del text[at:at + rng.randint(1, 6)]
        else:
            text.insert(at, rng.choice(["{", "}", "%", "{{", "{%", "'", "(", "|", "~", "*", "endfor", " if "]))
    return "".join(text)


def byte_level_vocab() -> tuple[list[str], list[str], list[str]]:
    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r", "Ġ a", "o n", "r e", "l l", "o r"]
    tokens = list(byte_alphabet().values()) + [m.replace(" ", "") for m in merges]
    return tokens, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], merges


# --- interesting values ---------------------------------------------------------------------------

def _u64_values(orig: int, size: int) -> list[int]:
    return [0, 1, 2, 3, 4, 7, 8, 255, 256, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40,
            1 << 48, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, orig - 1, orig + 1, orig * 2, orig + size, size]


def _u32_values(orig: int) -> list[int]:
    return [0, 1, 2, 3, 4, 7, 8, 12, 13, 29, 30, 31, 35, 39, 255, 0xFFFF, 0x10000, (1 << 31) - 1, 1 << 31,
            (1 << 32) - 1, orig - 1, orig + 1]


def pick_int(rng: random.Random, orig: int, nbytes: int, size: int) -> int:
    if rng.random() < 0.1:
        return rng.getrandbits(8 * nbytes)
    values = _u64_values(orig, size) if nbytes == 8 else _u32_values(orig)
    return rng.choice(values) % (1 << (8 * nbytes))


BAD_UTF8 = [b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\x80", b"\xf8\x88\x80\x80\x80"]
