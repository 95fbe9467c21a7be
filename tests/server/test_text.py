"""What the server needs of its text handling: stop strings are cut on the detokenized text across
token boundaries and never sent, text that may begin one is held, split characters wait for their
last byte (the tiny synthetic model's tokenizer)."""
from __future__ import annotations

import pytest

from rjax.server.text import ChoiceText


@pytest.fixture(scope="module")
def tok(tiny_path):
    from rjax.loading.tokenizer import Tokenizer

    return Tokenizer.from_gguf(str(tiny_path))


def _feed(text: ChoiceText, ids, chunk=1):
    pieces = [text.add(ids[i:i + chunk]).text for i in range(0, len(ids), chunk)]
    return pieces + [text.finish().text]


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_strings_are_cut_across_token_boundaries_and_never_sent(tok, chunk):
    ids = tok.encode("the cat sat on the mat")
    # " sat o" spans several tokens; "at o" begins inside one of them.
    for stop, expect in ((" sat o", "the cat"), ("at o", "the cat s"), ("mat", "the cat sat on the "),
                         ("dog", "the cat sat on the mat")):
        text = ChoiceText(tok, [stop, "zzz"])
        pieces = _feed(text, ids, chunk)
        assert "".join(pieces) == expect and text.stopped == (stop != "dog"), stop
        assert not any(stop in p for p in pieces)
    # Tokens counted: up to the one that completed the stop string.
    text = ChoiceText(tok, ["cat"])
    _feed(text, ids, chunk)
    assert text.n_tokens == len(tok.encode("the cat"))


def test_text_that_may_begin_a_stop_string_is_held_until_it_cannot(tok):
    text = ChoiceText(tok, ["cab"])
    assert text.add(tok.encode("xyzc")).text == "xyz"     # "c" may begin "cab"
    assert text.add(tok.encode("a")).text == ""           # "ca" still may
    assert text.add(tok.encode("t")).text == "cat"        # "cat" cannot
    assert text.finish().text == "" and not text.stopped
    text = ChoiceText(tok, ["cab"])
    assert text.add(tok.encode("ca")).text == "" and text.finish().text == "ca"  # the end releases it


def test_end_of_sequence_and_split_characters(tok):
    eos = next(iter(tok.eos_ids))
    text = ChoiceText(tok, [], hidden_ids=[eos])
    e_acute = tok.encode("é")
    assert len(e_acute) == 2  # one character, two byte tokens
    assert text.add(e_acute[:1]).text == ""
    assert text.add(e_acute[1:] + [eos]).text == "é"
    assert text.n_tokens == 3 and text.finish().text == ""
    # A stop string that ends inside a multi-byte character's text.
    text = ChoiceText(tok, ["aé"])
    assert "".join(_feed(text, tok.encode("xaéy"))) == "x" and text.stopped


def test_bytes_that_are_not_yet_a_character_are_held_until_one_completes(tok):
    """As the OpenAI API streams text: a character spread over byte tokens is sent once, whole;
    a byte that can begin no character is sent as U+FFFD once the next token shows it never will,
    and the pieces add up to the decoded sequence."""
    from rjax.loading.tokenizer import byte_alphabet

    emoji = tok.encode("🙂", add_bos=False)
    assert len(emoji) == 4  # one character, four byte tokens
    lone = tok.token_to_id(byte_alphabet()[0x80])  # a continuation byte with no lead byte
    ids = emoji + [lone] + tok.encode("ab", add_bos=False) + emoji[:2]
    text = ChoiceText(tok)
    pieces = _feed(text, ids)
    assert pieces[:4] == ["", "", "", "🙂"]
    assert pieces[4] == "" and pieces[5] == "\ufffda"
    assert "".join(pieces) == tok.decode(ids) and pieces[-1].endswith("\ufffd")  # the end flushes what never completed
