"""Logit adjustments: presence and frequency penalties and logit_bias (as the OpenAI API defines
them), the repetition penalty and min-p (as vLLM and llama.cpp do), against a NumPy reference of
those definitions: on random logits, and through the serving engine against a host loop that
takes each step's logits from a fresh forward pass (tiny synthetic model on the CPU)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from rjax.math.cache import init_cache
from rjax.math.model import forward
from rjax.math.sampling import MAX_LOGIT_BIAS, PROMPT_BIT, LogitAdjust, adjust_logits, check_adjust
from rjax.runtime.scheduler import sampling_variant
from rjax.runtime.serving import ServingConfig, ServingEngine

CONFIG = ServingConfig(n_slots=4, max_len=48, page_size=8, steps_per_dispatch=4, prefill_buckets=(4,))


def reference(logits, prompt, generated, temperature, presence=0.0, frequency=0.0, repetition=1.0, min_p=0.0,
              logit_bias=None):
    """One row by the definitions: logit_bias added; vLLM's repetition penalty over every token
    of the prompt and the output; OpenAI's mu[j] - c[j] * frequency - (c[j] > 0) * presence over
    the output's counts c; min-p removes tokens whose probability at `temperature` is below
    min_p times the largest."""
    x = np.array(logits, np.float64)
    for t, b in (logit_bias or {}).items():
        x[t] += b
    counts = np.bincount(np.asarray(generated, int), minlength=len(x))
    seen = (counts > 0) | np.isin(np.arange(len(x)), prompt)
    x = np.where(seen, np.where(x > 0, x / repetition, x * repetition), x)
    x = x - counts * frequency - (counts > 0) * presence
    if min_p > 0 and temperature > 0:
        p = np.exp((x - x.max()) / temperature)
        x = np.where(p < min_p * p.max(), -np.inf, x)
    return x


def test_adjust_logits_is_the_reference():
    rng = np.random.default_rng(0)
    V = 64
    rows = [dict(), dict(presence=0.7, frequency=0.4), dict(repetition=1.3), dict(repetition=0.8, presence=-1.0),
            dict(logit_bias={3: 5.0, 9: -100.0, 63: 2.5}), dict(min_p=0.2), dict(min_p=0.05, frequency=1.5,
                                                                                  logit_bias={0: 1.0})]
    temps = np.asarray([0.0, 1.0, 0.7, 1.0, 0.0, 0.8, 1.3], np.float32)
    logits = rng.normal(0, 3, (len(rows), V)).astype(np.float32)
    prompts = [rng.integers(0, V, 10) for _ in rows]
    gens = [rng.integers(0, V // 2, 12) for _ in rows]
    history = np.zeros((len(rows), V), np.int32)
    for i, (p, g) in enumerate(zip(prompts, gens)):
        history[i, p] = PROMPT_BIT
        np.add.at(history[i], g, 1)
    adj = LogitAdjust(*map(jnp.asarray, LogitAdjust.host(rows)))
    got = np.asarray(adjust_logits(jnp.asarray(logits), adj, jnp.asarray(history), jnp.asarray(temps)))
    for i, r in enumerate(rows):
        want = reference(logits[i], prompts[i], gens[i], temps[i], **r)
        assert np.array_equal(np.isinf(got[i]), np.isinf(want)), i
        np.testing.assert_allclose(got[i][np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6, atol=1e-5)
    assert np.array_equal(got[0], logits[0])   # neutral settings change nothing, bit for bit
    assert np.isinf(got[5]).any() and np.isinf(got[6]).any()


@pytest.mark.parametrize("bad, match", [
    (dict(presence=2.5), "presence_penalty"), (dict(frequency=float("nan")), "frequency_penalty"),
    (dict(repetition=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={64: 1.0}), "token id 64"), (dict(logit_bias={1: 101.0}), r"logit_bias\[1\]"),
    (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "at most 300")])
def test_out_of_range_adjustments_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        check_adjust(64, **bad)


@pytest.fixture(scope="module")
def host_greedy(tiny):
    """host_greedy(prompt, n, **adjust) -> n tokens: each step's logits from a fresh forward pass
    over the whole sequence, adjusted by `reference`, argmax on the host."""
    cfg, params = tiny
    T = CONFIG.max_len

    def run(prompt, n, **adjust):
        seq = list(prompt)
        for _ in range(n):
            tokens = np.zeros((1, T), np.int32)
            tokens[0, : len(seq)] = seq
            pos = np.where(np.arange(T) < len(seq), np.arange(T), -1)[None].astype(np.int32)
            logits, _ = forward(cfg, params, init_cache(cfg, 1, T), jnp.asarray(tokens), jnp.asarray(pos))
            x = reference(np.asarray(logits[0, len(seq) - 1]), prompt, seq[len(prompt):], 0.0, **adjust)
            seq.append(int(np.argmax(x)))
        return seq[len(prompt):]

    return run


def test_engine_penalties_bias_and_min_p_equal_the_reference_beside_plain_requests(tiny, host_greedy):
    """Four requests share a batch: plain greedy; greedy with all three penalties; greedy with a
    logit_bias; sampled at min_p 1 (only the most likely token survives, so it is greedy's). Each
    equals its host reference, so the adjusted program leaves the plain slot alone and counts
    each slot's own history (the prompt's too, for the repetition penalty)."""
    cfg, params = tiny
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (9, 14, 6, 11)]
    settings = [dict(), dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4),
                dict(logit_bias={7: 4.0, 11: 3.0}), dict(min_p=1.0)]
    n = 10
    eng = ServingEngine(cfg, params, CONFIG)
    ids = [eng.submit(p, max_new_tokens=n, temperature=0.9 if s.get("min_p") else 0.0, seed=i, stop_ids=(), **s)
           for i, (p, s) in enumerate(zip(prompts, settings))]
    done = {e.request_id: e.completion.tokens for e in eng.run() if e.finished}
    names = {"presence_penalty": "presence", "frequency_penalty": "frequency", "repetition_penalty": "repetition"}
    for i, p, s in zip(ids, prompts, settings):
        ref = {names.get(k, k): v for k, v in s.items() if k != "min_p"}
        assert done[i] == host_greedy(p, n, **ref), s
    assert done[ids[1]] != host_greedy(prompts[1], n), "the penalties changed nothing: a weak test"
    assert done[ids[2]] != host_greedy(prompts[2], n), "the bias changed nothing: a weak test"


def test_only_the_adjusted_dispatch_adjusts_and_counts(tiny):
    """The engine picks the adjusted decode program only while a running request adjusts; the
    other programs hold neither the adjustment nor the history's update, and leave the
    history as it was (donated through, not copied per row)."""
    cfg, params = tiny
    from rjax.engine import slots

    eng = ServingEngine(cfg, params, CONFIG)
    eng.submit([1, 2, 3], max_new_tokens=40, stop_ids=())
    eng.step()
    assert sampling_variant(eng.scheduler.running.values()) == (True, True, False)
    eng.submit([1, 2, 3], max_new_tokens=40, stop_ids=(), frequency_penalty=0.5)
    eng.step()
    assert sampling_variant(eng.scheduler.running.values()) == (False, True, True)
    rows = jnp.asarray([0, 1], jnp.int32)
    text = {a: slots.decode_dispatch.trace(cfg, params, eng.cache, eng.slots, 4, False, rows, not a, True, a)
            .lower().as_text() for a in (False, True)}
    assert "@adjust_logits" in text[True] and "@adjust_logits" not in text[False]
    assert text[False].count("tensor<4x512xi32>") < text[True].count("tensor<4x512xi32>")
