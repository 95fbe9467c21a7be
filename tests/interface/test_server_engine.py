"""What the server needs of the engine and of its text handling, without HTTP: cancellation
frees slots and pages at once, seeded sampling does not depend on what runs beside it,
log-probabilities equal log_softmax of the logits and add one compiled program at most, and
stop strings are cut on the detokenized text across token boundaries (tiny synthetic model on
the CPU)."""
from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

import rjax
from rjax import serving, slots
from rjax.server.text import ChoiceText
from rjax.serving import ServingConfig, ServingEngine
from rjax.sampling import MAX_TOP_LOGPROBS

CONFIG = ServingConfig(n_slots=4, max_len=64, page_size=8, steps_per_dispatch=4, prefill_buckets=(4,))


def _drain(eng):
    done, streamed = {}, {}
    for e in eng.run():
        streamed.setdefault(e.request_id, []).extend(e.tokens)
        if e.finished:
            done[e.request_id] = e.completion
    return done, streamed


def _check_idle(eng):
    assert eng.n_running == 0 and eng.n_queued == 0 and eng.n_free_slots == eng.config.n_slots
    assert eng.pages_in_use == 0 and eng.pages.unreserved == eng.pages.n_pages
    np.testing.assert_array_equal(np.asarray(eng.cache.lengths), 0)
    assert np.asarray(eng.slots.state.done).all()


def test_cancel_frees_a_running_and_a_queued_request_at_the_next_step(tiny):
    cfg, params = tiny
    eng = ServingEngine(cfg, params, CONFIG)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    ids = [eng.submit(p, max_new_tokens=40) for p in prompts]  # 4 run, 1 waits
    eng.step()
    assert eng.n_running == 4 and eng.n_queued == 1
    slot = next(s for s, r in eng.scheduler.running.items() if r.request_id == ids[1])
    assert eng.pages.owned[slot] > 0
    eng.cancel(ids[1])      # running
    eng.cancel(ids[4])      # queued
    eng.cancel("unknown")   # ignored
    events = eng.step()
    cancelled = {e.request_id: e.completion for e in events if e.finished}
    assert set(cancelled) == {ids[1], ids[4]}
    assert all(c.finish_reason == "cancelled" for c in cancelled.values())
    assert cancelled[ids[4]].tokens == [] and len(cancelled[ids[1]].tokens) >= 1
    # Its pages went back at once, and the device forgot the slot (done, length 0, no table).
    assert eng.pages.owned[slot] == 0 and eng.pages_in_use == int(eng.pages.owned.sum())
    assert slot in eng.scheduler.free and eng.n_running == 3 and eng.n_queued == 0
    assert bool(eng.slots.state.done[slot]) and int(eng.cache.lengths[slot]) == 0
    assert (np.asarray(eng.cache.block_tables[slot]) == -1).all()
    done, _ = _drain(eng)
    # The others ran on undisturbed: they equal a run without the cancelled ones.
    ref = serving.serve(cfg, params, [prompts[i] for i in (0, 2, 3)], CONFIG, max_new_tokens=40)
    assert [done[ids[i]].tokens for i in (0, 2, 3)] == [c.tokens for c in ref]
    _check_idle(eng)
    eng.cancel(ids[0])  # already finished: nothing happens
    assert eng.step() == [] and not eng.has_work


def test_a_seeded_request_samples_the_same_tokens_whatever_runs_beside_it(tiny):
    cfg, params = tiny
    kw = dict(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9)
    alone = ServingEngine(cfg, params, CONFIG)
    a = alone.submit([1, 2, 3], seed=42, **kw)
    b = alone.submit([1, 2, 3], seed=42, sample_index=1, **kw)
    done, _ = _drain(alone)
    assert done[a].tokens != done[b].tokens  # two samples of one seed differ
    crowded = ServingEngine(cfg, params, CONFIG, seed=5)
    for p in ([4, 5], [6], [7, 8, 9]):
        crowded.submit(p, max_new_tokens=20, temperature=0.7)
    crowded.step()  # the seeded request joins mid-way, into another slot
    c = crowded.submit([1, 2, 3], seed=42, **kw)
    d = crowded.submit([1, 2, 3], seed=42 + 2 ** 64, **kw)  # seeds are taken modulo 2**64
    got, _ = _drain(crowded)
    assert got[c].tokens == done[a].tokens and got[d].tokens == done[a].tokens


def _log_softmax_after(cfg, params, seq):
    tokens, lengths = rjax.pad_prompts([list(seq)])
    logits, _ = rjax.prefill(cfg, params, rjax.init_cache(cfg, 1, CONFIG.max_len), jnp.asarray(tokens),
                             jnp.asarray(lengths))
    x = np.asarray(logits[0], np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_logprobs_are_log_softmax_and_cost_one_program(tiny):
    cfg, params = tiny
    eng = ServingEngine(cfg, params, CONFIG)
    plain = eng.submit([3, 1, 4, 1, 5], max_new_tokens=6)
    first, _ = _drain(eng)
    before = slots.decode_dispatch.compiled_count()
    with_lp = eng.submit([3, 1, 4, 1, 5], max_new_tokens=6, logprobs=True)
    sampled = eng.submit([2, 7, 1, 8], max_new_tokens=6, logprobs=True, temperature=1.0, seed=1)
    other = eng.submit([9, 9], max_new_tokens=6)
    done, _ = _drain(eng)
    assert slots.decode_dispatch.compiled_count() <= before + 1
    assert done[other].logprobs is None and first[plain].logprobs is None
    for rid, prompt in ((with_lp, [3, 1, 4, 1, 5]), (sampled, [2, 7, 1, 8])):
        c = done[rid]
        assert len(c.logprobs) == len(c.tokens) == 6
        for i, (t, e) in enumerate(zip(c.tokens, c.logprobs)):
            ref = _log_softmax_after(cfg, params, prompt + c.tokens[:i])
            assert e.token == t and e.logprob == pytest.approx(ref[t], abs=2e-4)
            ids = [j for j, _ in e.top]
            assert len(ids) == MAX_TOP_LOGPROBS
            np.testing.assert_allclose([v for _, v in e.top], np.sort(ref)[::-1][:MAX_TOP_LOGPROBS], atol=2e-4)
            np.testing.assert_allclose(ref[ids], [v for _, v in e.top], atol=2e-4)
    # Greedy tokens are the same with and without logprobs.
    assert done[with_lp].tokens == first[plain].tokens
    _check_idle(eng)


# --- stop strings on the text --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok(tiny_path):
    from rjax.tokenizer import Tokenizer

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
    from rjax.tokenizer import byte_alphabet

    emoji = tok.encode("🙂", add_bos=False)
    assert len(emoji) == 4  # one character, four byte tokens
    lone = tok.token_to_id(byte_alphabet()[0x80])  # a continuation byte with no lead byte
    ids = emoji + [lone] + tok.encode("ab", add_bos=False) + emoji[:2]
    text = ChoiceText(tok)
    pieces = _feed(text, ids)
    assert pieces[:4] == ["", "", "", "🙂"]
    assert pieces[4] == "" and pieces[5] == "\ufffda"
    assert "".join(pieces) == tok.decode(ids) and pieces[-1].endswith("\ufffd")  # the end flushes what never completed
