"""Speculative decoding with prompt-lookup drafts: greedy output token for token equal to plain
greedy decoding (prompts with and without repetition, drafts cut by the token limit and the end
of the cache), the acceptance rule's output distribution equal to plain sampling's, and the
drafter itself."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rjax
from rjax import engine
from rjax.cache import init_cache
from rjax.sampling import SamplingParams
from rjax.speculative import NgramDrafter, SpeculativeStats, accept, speculative_ids

REPEATING = [5, 6, 7, 8, 9, 10] * 3 + [5, 6]
PLAIN = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38]


def test_ngram_drafter_finds_the_latest_longest_match():
    d = NgramDrafter(max_ngram=3)
    assert d.draft([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], 2) == [4, 9]     # the 3-gram [1, 2, 3] at 0
    assert d.draft([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert d.draft([7, 8, 9, 8], 2) == [9, 8]                         # falls back to the 1-gram [8]
    assert d.draft([1, 2, 3], 4) == []
    assert d.draft([4, 4], 3) == [4]


def _greedy(cfg, params, prompt, n, max_len):
    cache = init_cache(cfg, 1, max_len)
    t, l = engine.pad_prompts([prompt])
    logits, cache = engine.prefill(cfg, params, cache, jnp.asarray(t), jnp.asarray(l))
    out = [int(jnp.argmax(logits[0]))]
    while len(out) < n and len(prompt) + len(out) <= max_len:
        logits, cache = engine.decode_step(cfg, params, cache, jnp.asarray([out[-1]], jnp.int32))
        out.append(int(jnp.argmax(logits[0])))
    return out


def _speculative(cfg, params, prompt, n, max_len, k, stats=None):
    out = []
    for new in speculative_ids(cfg, params, init_cache(cfg, 1, max_len), prompt, max_new_tokens=n,
                               sp=SamplingParams.make(1), draft_tokens=k, stats=stats):
        out += new
    return out


@pytest.mark.parametrize("k", [1, 4, 7])
@pytest.mark.parametrize("prompt", [REPEATING, PLAIN], ids=["repeating", "plain"])
def test_greedy_equals_plain_greedy(tiny, prompt, k):
    cfg, params = tiny
    stats = SpeculativeStats()
    want = _greedy(cfg, params, prompt, 40, 128)
    assert _speculative(cfg, params, prompt, 40, 128, k, stats) == want
    assert stats.accepted <= stats.drafted and stats.steps < 40
    if prompt is REPEATING:
        assert stats.accepted > 0


def test_drafts_cut_by_the_token_limit_and_the_cache_end(tiny):
    cfg, params = tiny
    for n in (1, 2, 5, 11):   # budgets that end inside a draft
        assert _speculative(cfg, params, REPEATING, n, 128, 4) == _greedy(cfg, params, REPEATING, n, 128)
    # A 32-position cache: generation stops when it is full, drafts shortened to fit.
    assert _speculative(cfg, params, REPEATING, 40, 32, 6) == _greedy(cfg, params, REPEATING, 40, 32)


def test_generate_and_its_checks(tiny_path):
    model = rjax.load(tiny_path, progress=False)
    plain = rjax.generate(model, "abcabcabcabc", raw=True, max_new_tokens=24)
    spec = rjax.generate(model, "abcabcabcabc", raw=True, max_new_tokens=24, speculative="ngram", draft_tokens=3)
    assert spec.tokens == plain.tokens and spec.text == plain.text and spec.finish_reason == plain.finish_reason
    assert spec.speculative["drafted"] >= spec.speculative["accepted"] >= 0
    with pytest.raises(ValueError, match="speculative must be one of"):
        rjax.generate(model, "x", speculative="medusa")
    with pytest.raises(ValueError, match="draft_tokens"):
        rjax.generate(model, "x", speculative="ngram", draft_tokens=0)
    with pytest.raises(ValueError, match="one prompt"):
        rjax.generate(model, ["x", "y"], speculative="ngram")


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_acceptance_leaves_the_sampling_distribution_unchanged(temperature, top_k, top_p):
    """The first emitted token of a verification: either the accepted draft or a draw after its
    rejection. Over many keys its frequencies match the target distribution (top-k, top-p and
    temperature applied), whichever token was drafted."""
    V, K, n = 8, 3, 40_000
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(K + 1, V)) * 1.5, jnp.float32)
    sp = SamplingParams.make(1, temperature, top_k, top_p)
    want = np.asarray(jax.nn.softmax(rjax.sampling.filtered_logits(logits[:1], sp))[0], np.float64)
    for drafted in (int(np.argmax(want)), int(np.argsort(want)[-3])):
        drafts = jnp.asarray([drafted, 1, 2], jnp.int32)
        m, nxt = jax.vmap(lambda key: accept(logits, drafts, jnp.int32(K), key, sp))(
            jax.random.split(jax.random.key(drafted), n))
        first = np.where(np.asarray(m) > 0, drafted, np.asarray(nxt))
        freq = np.bincount(first, minlength=V) / n
        # 5 standard deviations of a binomial frequency, per token.
        assert np.all(np.abs(freq - want) <= 5 * np.sqrt(want * (1 - want) / n) + 1e-9), (freq, want)


def test_greedy_acceptance_keeps_the_agreeing_prefix():
    logits = jnp.full((5, 6), -5.0).at[jnp.arange(5), jnp.asarray([2, 3, 1, 4, 0])].set(5.0)
    sp = SamplingParams.make(1)
    key = jax.random.key(0)
    for drafts, n, want in (([2, 3, 9, 9], 4, (2, 1)), ([2, 3, 1, 4], 4, (4, 0)), ([5, 3, 1, 4], 4, (0, 2)),
                            ([2, 3, 1, 4], 2, (2, 1))):
        m, nxt = accept(logits, jnp.asarray(drafts, jnp.int32), jnp.int32(n), key, sp)
        assert (int(m), int(nxt)) == want, (drafts, n)


@pytest.mark.slow
def test_default_model_greedy_equal(smollm2):
    """The real default model: a prompt that invites repetition and one that does not."""
    for text in ("List the numbers from 1 to 20, separated by commas.", "Write a haiku about the sea."):
        plain = rjax.generate(smollm2, text, max_new_tokens=40)
        spec = rjax.generate(smollm2, text, max_new_tokens=40, speculative="ngram", draft_tokens=4)
        assert spec.tokens == plain.tokens, text
