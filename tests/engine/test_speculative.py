"""Speculative decoding with prompt-lookup and draft-model drafters: greedy output token for
token equal to plain greedy decoding (prompts with and without repetition, drafts that run past
a stop id, the token limit or the end of the cache), rejected K/V never visible after rollback,
sampled output distributed as plain sampling, and the drafters themselves."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gguf_blocks.requantize import requantize_tree
import rjax
from rjax.engine import steps
from rjax.engine.slots import init_slots, prefill_into_slots
from rjax.engine.speculative import (ModelDrafter, NgramDrafter, SpeculativeStats, accept, draft_prefill,
                                     speculative_dispatch, speculative_ids)
from rjax.loading.catalog import CatalogError
from rjax.math.cache import init_cache
from rjax.math.config import ModelConfig
from rjax.math.model import forward
from rjax.math.params import LayerParams, Params
from rjax.math.plan import decode_positions
from rjax.math.sampling import SamplingParams
from rjax.math.sampling import LogitAdjust
from rjax.runtime.generation import default_draft_tokens

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
    t, l = steps.pad_prompts([prompt])
    logits, cache = steps.prefill(cfg, params, cache, jnp.asarray(t), jnp.asarray(l))
    out = [int(jnp.argmax(logits[0]))]
    while len(out) < n and len(prompt) + len(out) <= max_len:
        logits, cache = steps.decode_step(cfg, params, cache, jnp.asarray([out[-1]], jnp.int32))
        out.append(int(jnp.argmax(logits[0])))
    return out


def _speculative(cfg, params, prompt, n, max_len, k, stats=None, draft=None, stop_ids=()):
    """draft: None (prompt lookup) or (config, params) of a draft model."""
    out, stats = [], stats if stats is not None else SpeculativeStats()
    kw = {} if draft is None else dict(drafter=ModelDrafter(draft[0]), draft_params=draft[1],
                                       draft_cache=init_cache(draft[0], 1, max_len))
    for new in speculative_ids(cfg, params, init_cache(cfg, 1, max_len), prompt, max_new_tokens=n,
                               sp=SamplingParams.make(1), draft_tokens=k, stats=stats, stop_ids=stop_ids, **kw):
        out += new
    # The final cache holds the prompt and every token but the last, however the last round ended.
    assert int(stats.cache.lengths[0]) == len(prompt) + len(out) - 1
    return out


@pytest.fixture(scope="module")
def drafts(tiny, tmp_path_factory):
    """Draft models for `tiny`: itself requantized to Q4_0 (mostly agrees) and an unrelated
    one-layer model of the same vocabulary (mostly disagrees: many rejections)."""
    from rjax.loading.loaders.gguf import load_gguf
    from rjax.loading.synth import write_synthetic

    cfg, params = tiny
    path = write_synthetic(tmp_path_factory.mktemp("synth") / "other.gguf", "smollm2-135m", "q8_0", seed=4,
                           n_layers=1, vocab_size=512, tokenizer_from="builtin")
    other_cfg, other_params, _ = load_gguf(path, progress=False)
    return {"self_q4_0": (cfg, requantize_tree(params, "q4_0")), "other": (other_cfg, other_params)}


def test_device_lookup_equals_the_host_drafter():
    d = NgramDrafter()
    lookup = jax.jit(lambda h, n: d.lookup(h, n, 5))
    rng = np.random.default_rng(1)
    for trial in range(200):
        n = int(rng.integers(1, 40))
        tokens = rng.integers(0, 4 if trial % 2 else 12, size=n).tolist()
        hist = np.zeros(48, np.int32)
        hist[:n], hist[n:] = tokens, rng.integers(0, 4, size=48 - n)   # junk past the length is never used
        got, real = lookup(jnp.asarray(hist), jnp.int32(n))
        assert np.asarray(got)[: int(real)].tolist() == d.draft(tokens, 5), tokens


@pytest.mark.parametrize("which", ["self_q4_0", "other"])
@pytest.mark.parametrize("prompt", [REPEATING, PLAIN], ids=["repeating", "plain"])
def test_draft_model_greedy_equals_plain_greedy(tiny, drafts, prompt, which):
    cfg, params = tiny
    stats = SpeculativeStats()
    assert _speculative(cfg, params, prompt, 30, 128, 4, stats, drafts[which]) == _greedy(cfg, params, prompt, 30, 128)
    assert 0 <= stats.accepted <= stats.drafted <= 4 * stats.steps
    if which == "self_q4_0":
        assert stats.accepted > stats.drafted // 2   # its own copy mostly agrees
    else:
        assert stats.accepted < stats.drafted        # rejections happened: rollback was exercised


@pytest.mark.parametrize("which", [None, "other"])
def test_drafts_past_a_stop_id_the_token_limit_and_the_cache_end(tiny, drafts, which):
    cfg, params = tiny
    draft = None if which is None else drafts[which]
    want = _greedy(cfg, params, REPEATING, 40, 128)
    # A stop id first generated mid-way: drafts beyond it are dropped, the stop id ends the output.
    stop = next(t for t in want[8:] if t not in want[:8])
    cut = want[: want.index(stop) + 1]
    assert _speculative(cfg, params, REPEATING, 40, 128, 4, draft=draft, stop_ids=[stop]) == cut
    for n in (1, 2, 5, 11):   # budgets that end inside a draft
        assert _speculative(cfg, params, REPEATING, n, 128, 4, draft=draft) == want[:n]
    # A 32-position cache: generation stops when it is full, drafts shortened to fit.
    assert _speculative(cfg, params, REPEATING, 40, 32, 4, draft=draft) == _greedy(cfg, params, REPEATING, 40, 32)


def _slot_batch(cfg, params, prompts, S, sp, budget, drafter=NgramDrafter(), dparams=None):
    """`prompts` prefilled into a contiguous cache of one row each and started as the server
    starts requests (`prefill_into_slots`, row i of seed i), with each row's drafter state.
    -> (cache, slots, draft, first tokens [P])."""
    P = len(prompts)
    t, l = steps.pad_prompts(prompts)
    args = (jnp.asarray(t), jnp.asarray(l), jnp.arange(P, dtype=jnp.int32))
    seeds = jnp.stack([jnp.arange(P), jnp.zeros(P, jnp.int32)], 1).astype(jnp.uint32)
    first, _, batch, cache = prefill_into_slots(
        cfg, params, init_cache(cfg, P, S), init_slots(P, 1, cfg.vocab_size), *args, jnp.ones(P, bool), seeds,
        jnp.zeros(P, jnp.uint32), sp, jnp.full(P, budget, jnp.int32), jnp.full((P, 1), -1, jnp.int32),
        LogitAdjust.make(P), jnp.full((P, (cfg.vocab_size + 31) // 32), -1, jnp.int32))
    if isinstance(drafter, ModelDrafter):
        return cache, batch, draft_prefill(drafter.cfg, dparams, init_cache(drafter.cfg, P, S),
                                           jnp.full(P, -1, jnp.int32), *args), first
    hist = jnp.zeros((P, S + 1), jnp.int32).at[:, : t.shape[1]].set(jnp.asarray(t))
    hist = hist.at[jnp.arange(P), jnp.asarray(l)].set(first)
    return cache, batch, (hist, jnp.asarray(l) + 1), first


def _poison(cache, value=1e4):
    """K and V past each slot's length set to `value`: if any attention saw them, logits would move."""
    S = cache.max_len
    beyond = (jnp.arange(S)[None, :] >= cache.lengths[:, None])[:, None, :, None]
    return dataclasses.replace(cache, k=tuple(jnp.where(beyond, value, k) for k in cache.k),
                               v=tuple(jnp.where(beyond, value, v) for v in cache.v))


@pytest.mark.parametrize("which", [None, "other"])
def test_rolled_back_kv_is_never_visible(tiny, drafts, which):
    """One round per call, both caches poisoned past their lengths between rounds (where the
    rejected drafts' K/V lie): the output is still plain greedy's, so nothing past a length is
    ever read; and the rounds did reject."""
    cfg, params = tiny
    prompt, S, k = PLAIN, 128, 4
    want = _greedy(cfg, params, prompt, 30, S)
    drafter, dparams = NgramDrafter(), None
    if which is not None:
        dcfg, dparams = drafts[which]
        drafter = ModelDrafter(dcfg)
    cache, batch, draft, first = _slot_batch(cfg, params, [prompt], S, SamplingParams.make(1), 30, drafter, dparams)
    out, drafted, accepted = [int(first[0])], 0, 0
    while not bool(batch.state.done[0]):
        cache = _poison(cache)
        if which is not None:
            draft = (_poison(draft[0]), draft[1])
        rows, n, m, batch, cache, draft = speculative_dispatch(cfg, params, cache, batch, drafter, dparams, draft, k, 1)
        out += [int(x) for x in np.asarray(rows).ravel() if x >= 0]
        drafted, accepted = drafted + int(n[0]), accepted + int(m[0])
    assert out == want
    assert accepted < drafted


@pytest.mark.parametrize("model_drafter", [False, True])
def test_greedy_program_holds_no_sampling(tiny, model_drafter):
    """greedy=True (what speculative_ids passes at temperature 0) leaves sampling out of the
    program: no top-k / top-p filters and fewer conditionals than the program that
    decides by the temperature at run time."""
    cfg, params = tiny
    S, k = 64, 4
    drafter, dparams = (ModelDrafter(cfg), params) if model_drafter else (NgramDrafter(), None)
    cache, batch, draft, _ = _slot_batch(cfg, params, [PLAIN], S, SamplingParams.make(1), 8, drafter, dparams)
    text = {greedy: speculative_dispatch.trace(cfg, params, cache, batch, drafter, dparams, draft, k, 2, None,
                                               greedy).lower().as_text() for greedy in (False, True)}
    assert "@filtered_logits" in text[False] and "@filtered_logits" not in text[True]


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("prompt", [REPEATING, PLAIN], ids=["repeating", "plain"])
def test_greedy_equals_plain_greedy(tiny, prompt, k):
    cfg, params = tiny
    stats = SpeculativeStats()
    want = _greedy(cfg, params, prompt, 40, 128)
    assert _speculative(cfg, params, prompt, 40, 128, k, stats) == want
    assert stats.accepted <= stats.drafted and stats.steps < 40
    if prompt is REPEATING:
        assert stats.accepted > 0


def test_generate_and_its_checks(tiny_path):
    model = rjax.load(tiny_path, progress=False)
    plain = rjax.generate(model, "abcabcabcabc", raw=True, max_new_tokens=24)
    spec = rjax.generate(model, "abcabcabcabc", raw=True, max_new_tokens=24, speculative="ngram", draft_tokens=3)
    assert spec.tokens == plain.tokens and spec.text == plain.text and spec.finish_reason == plain.finish_reason
    assert spec.speculative["drafted"] >= spec.speculative["accepted"] >= 0
    # Its decode rate leaves out compiling the loop, which a second run finds compiled.
    again = rjax.generate(model, "abcabcabcabc", raw=True, max_new_tokens=24, speculative="ngram", draft_tokens=3)
    assert again.tokens == spec.tokens and again.speculative["compile_s"] == 0 < spec.speculative["compile_s"]
    # No K given: prompt lookup drafts as many as the decode attention kernel verifies in one tile.
    wide = rjax.generate(model, "abcabcabcabc", raw=True, max_new_tokens=24, speculative="ngram")
    cfg = model.config
    k = default_draft_tokens(cfg, NgramDrafter())
    assert wide.tokens == plain.tokens and set(wide.speculative["k_used"]) == {k}
    assert k + 1 == min(16, decode_positions(cfg))
    assert default_draft_tokens(cfg, ModelDrafter(cfg)) == 4
    with pytest.raises(CatalogError, match="medusa"):
        rjax.generate(model, "x", raw=True, speculative="medusa")
    with pytest.raises(ValueError, match="self:q4_0"):
        rjax.generate(model, "x", raw=True, speculative="self:q2_k")
    with pytest.raises(ValueError, match="draft_tokens"):
        rjax.generate(model, "x", speculative="ngram", draft_tokens=0)
    # A list takes every drafter one prompt takes (tests/runtime/test_serving_speculative.py runs one with a
    # draft model), refused alike where it is wrong, and a fixed K only.
    with pytest.raises(ValueError, match="self:q4_0"):
        rjax.generate(model, ["x", "y"], raw=True, speculative="self:q2_k")
    with pytest.raises(ValueError, match="draft_tokens='auto' is for one prompt"):
        rjax.generate(model, ["x", "y"], raw=True, speculative="self:q4_0", draft_tokens="auto")


@pytest.mark.slow
def test_generate_with_a_self_draft_and_a_list(tiny_path):
    """rjax.generate's other spellings: the model requantized as its own draft, and a list of
    prompts through the speculative serving engine."""
    model = rjax.load(tiny_path, progress=False)
    plain = rjax.generate(model, "abcabcabcabc", raw=True, max_new_tokens=24)
    self_draft = rjax.generate(model, "abcabcabcabc", raw=True, max_new_tokens=24, speculative="self:q4_0")
    assert self_draft.tokens == plain.tokens and self_draft.speculative["accepted"] > 0
    auto = rjax.generate(model, "abcabcabcabc", raw=True, max_new_tokens=24, speculative="self:q4_0",
                         draft_tokens="auto")
    assert auto.tokens == plain.tokens and set(auto.speculative["k_used"]) <= {2, 4, 7}
    texts = ["abcabcabcabc", "xyzxyzxy"]
    plain_list = rjax.generate(model, texts, raw=True, max_new_tokens=12)
    spec_list = rjax.generate(model, texts, raw=True, max_new_tokens=12, speculative="ngram", draft_tokens=3)
    assert [r.tokens for r in spec_list] == [r.tokens for r in plain_list]
    assert all(0 <= r.speculative["accepted"] <= r.speculative["drafted"] for r in spec_list)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_acceptance_leaves_the_sampling_distribution_unchanged(temperature, top_k, top_p):
    """The first emitted token of a verification: either the accepted draft or a draw after its
    rejection. Over many keys its frequencies match the target distribution (top-k, top-p and
    temperature applied), whichever token was drafted."""
    V, K, n = 8, 3, 40_000
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(K + 1, V)) * 1.5, jnp.float32)
    sp = SamplingParams.make(1, temperature, top_k, top_p)
    want = np.asarray(jax.nn.softmax(rjax.math.sampling.filtered_logits(logits[:1], sp))[0], np.float64)
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
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_real_models_greedy_equal(name, request):
    """The default model and gemma3-270m, with prompt lookup and with the model's own weights
    requantized to Q4_0 as its draft: a prompt that invites repetition and one that does not,
    each token for token plain greedy's; replies that end at an end-of-sequence token inside a
    round of drafts included. (gemma3-270m: 24 tokens, 6 or more rounds of drafts; each of its
    steps on the CPU reads a 262,144-row Q8_0 LM head, and both its replies run to the limit.)"""
    max_new = 40 if name == "smollm2" else 24   # smollm2's short reply stops at its 30th token
    path = request.getfixturevalue(f"{name}_path")
    model = request.getfixturevalue("smollm2") if name == "smollm2" else rjax.load(path, progress=False)
    draft = rjax.load(path, progress=False, requantize="q4_0")
    reasons, accepted = set(), {"ngram": 0, "draft": 0}
    for text in ("List the numbers from 1 to 20, separated by commas.", "Say hello in one word."):
        plain = rjax.generate(model, text, max_new_tokens=max_new)
        reasons.add(plain.finish_reason)
        for kind, speculative in (("ngram", "ngram"), ("draft", draft)):
            spec = rjax.generate(model, text, max_new_tokens=max_new, speculative=speculative, draft_tokens=4)
            assert spec.tokens == plain.tokens, (text, spec.speculative)
            assert spec.finish_reason == plain.finish_reason
            accepted[kind] += spec.speculative["accepted"]
    assert min(accepted.values()) > 0, accepted
    if name == "smollm2":   # its short reply ends at end-of-sequence inside a round of drafts
        assert "stop" in reasons, reasons


def _small_model(seed, V=4, d=32, base: Params | None = None, noise=0.0):
    """A one-layer dense llama of vocabulary V with random weights (or `base` plus noise): cheap
    enough to sample tens of thousands of sequences at once."""
    cfg = ModelConfig(arch="llama", n_layers=1, d_model=d, d_ff=64, n_heads=2, n_kv_heads=1, head_dim=16,
                      vocab_size=V, context_length=64, rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False)
    keys = iter(jax.random.split(jax.random.key(seed), 16))

    def w(*shape, scale=1.0):
        return jax.random.normal(next(keys), shape) * scale / np.sqrt(shape[-1])

    if base is None:
        layer = LayerParams(jnp.ones(d), w(32, d), w(16, d), w(16, d), w(d, 32), jnp.ones(d), w(64, d), w(64, d),
                            w(d, 64))
        return cfg, Params(w(V, d, scale=np.sqrt(d)), (layer,), jnp.ones(d), w(V, d, scale=2.0))
    return cfg, jax.tree.map(lambda x: x + noise * jax.random.normal(next(keys), x.shape) * jnp.std(x)
                             if x.ndim == 2 else x, base)


def _exact_joint(cfg, params, prompt, n, sp):
    """p(t1..tn | prompt) under filtered sampling, for every sequence of n tokens: [V] * n."""
    V = cfg.vocab_size
    seqs = np.array(np.meshgrid(*[np.arange(V)] * (n - 1), indexing="ij")).reshape(n - 1, -1).T
    tokens = jnp.asarray(np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, _ = forward(cfg, params, init_cache(cfg, len(seqs), 16), tokens, pos)
    rows = logits[:, len(prompt) - 1:].reshape(-1, V)
    probs = np.asarray(jax.nn.softmax(rjax.math.sampling.filtered_logits(
        rows, jax.tree.map(lambda a: jnp.broadcast_to(a[:1], (rows.shape[0],)), sp))), np.float64)
    probs = probs.reshape(len(seqs), n, V)
    joint = np.ones([V] * n)
    for idx in np.ndindex(*joint.shape):
        row = int(np.ravel_multi_index(idx[:-1], [V] * (n - 1))) if n > 1 else 0
        joint[idx] = np.prod([probs[row, i, idx[i]] for i in range(n)])
    return joint


def _speculative_samples(cfg, params, prompt, n, sp, drafter, dparams, k, n_runs):
    """n_runs independent speculative generations (a slot batch of n_runs rows, one seed each)
    in one dispatch. -> ([n_runs, n] tokens, drafted [n_runs], accepted [n_runs])."""
    sp = jax.tree.map(lambda a: jnp.broadcast_to(a, (n_runs,)), sp)
    cache, batch, draft, first = _slot_batch(cfg, params, [prompt] * n_runs, 16, sp, n, drafter, dparams)
    rows, drafted, accepted, *_ = speculative_dispatch(cfg, params, cache, batch, drafter, dparams, draft, k, n)
    rows = np.asarray(rows)
    order = np.argsort(rows < 0, axis=1, kind="stable")   # emitted tokens first, in order
    seqs = np.concatenate([np.asarray(first)[:, None], np.take_along_axis(rows, order, 1)[:, : n - 1]], axis=1)
    return seqs, drafted, accepted


@pytest.mark.parametrize("drafter_kind, temperature, top_k, top_p", [("ngram", 1.0, 0, 1.0), ("model", 0.8, 3, 0.9)])
def test_sampled_sequences_are_distributed_as_plain_sampling(drafter_kind, temperature, top_k, top_p):
    """Many seeds of a vocabulary-4 model: the joint frequencies of the first 5 generated tokens
    (1,024 sequences) match the exact plain-sampling probabilities (chi-square), with drafts
    accepted and rejected along the way."""
    from scipy import stats as scipy_stats

    cfg, params = _small_model(0)
    prompt, n, N = [0, 1, 2, 3, 0, 1], 5, 20_000
    sp = SamplingParams.make(1, temperature, top_k, top_p)
    if drafter_kind == "ngram":
        drafter, dparams = NgramDrafter(), None
    else:
        dcfg, dparams = _small_model(1, base=params, noise=0.5)
        drafter = ModelDrafter(dcfg)
    seqs, drafted, accepted = _speculative_samples(cfg, params, prompt, n, sp, drafter, dparams, 3, N)
    seqs = np.asarray(seqs)
    assert (seqs >= 0).all()
    drafted, accepted = int(np.sum(drafted)), int(np.sum(accepted))
    assert 0.1 * drafted < accepted < 0.95 * drafted, (accepted, drafted)   # both outcomes exercised
    want = _exact_joint(cfg, params, prompt, n, sp).ravel() * N
    got = np.bincount(np.ravel_multi_index(seqs.T, [cfg.vocab_size] * n), minlength=want.size)
    assert got[want == 0].sum() == 0     # nothing outside top-k / top-p
    big = want >= 5                      # chi-square cells; the rare ones pooled
    obs = np.append(got[big], got[~big & (want > 0)].sum())
    exp = np.append(want[big], want[~big & (want > 0)].sum())
    p = scipy_stats.chisquare(obs[exp > 0], exp[exp > 0] * obs.sum() / exp.sum()).pvalue
    assert p > 1e-4, p


def test_draft_model_of_another_vocabulary_is_refused(tiny_path, tmp_path):
    from rjax.loading.synth import write_synthetic

    model = rjax.load(tiny_path, progress=False)
    other = write_synthetic(tmp_path / "v1024.gguf", "smollm2-135m", "q8_0", seed=1, n_layers=1, vocab_size=1024,
                            tokenizer_from="builtin")
    with pytest.raises(ValueError, match="draft model v1024.gguf has a vocabulary of 1,024 tokens, the target 512"):
        rjax.generate(model, "x", raw=True, speculative=str(other))


def test_speculative_serving_equals_plain_serving(tiny):
    """A speculative serving engine (prompt lookup, drafts of all slots verified in one pass per
    round) gives each request the tokens and finish reason a plain engine gives it: more requests
    than slots, budgets ending inside drafts, a stop id reached inside a round; each completion
    reports its own drafts and acceptances."""
    from rjax.runtime.serving import ServingConfig, ServingEngine

    cfg, params = tiny
    want_plain = _greedy(cfg, params, REPEATING, 30, 128)
    stop = next(t for t in want_plain[8:] if t not in want_plain[:8])
    prompts = [(REPEATING, 30), (PLAIN, 17), (REPEATING[3:], 9), (PLAIN[::-1] * 2, 25), (REPEATING + PLAIN, 30),
               (REPEATING[:7], 2)]
    results = {}
    for spec in (None, "ngram"):
        config = ServingConfig(n_slots=3, max_len=128, page_size=16, steps_per_dispatch=4, speculative=spec,
                               draft_tokens=4)
        eng = ServingEngine(cfg, params, config, stop_ids=[stop])
        ids = [eng.submit(p, max_new_tokens=n) for p, n in prompts]
        done = {e.request_id: e.completion for e in eng.run() if e.finished}
        results[spec] = [done[i] for i in ids]
        totals = eng.speculative_stats
    for plain, spec in zip(results[None], results["ngram"]):
        assert spec.tokens == plain.tokens and spec.finish_reason == plain.finish_reason
        assert 0 <= spec.accepted <= spec.drafted and plain.drafted == 0
    assert "stop" in {c.finish_reason for c in results["ngram"]}
    assert totals["accepted"] == sum(c.accepted for c in results["ngram"]) > 0
    with pytest.raises(ValueError, match="ServingConfig.speculative"):
        ServingConfig(speculative="self:q4_0")
    with pytest.raises(ValueError, match="ServingConfig.draft_tokens"):
        ServingConfig(speculative="ngram", draft_tokens=0)


def test_choose_k_follows_the_acceptance_rate():
    from rjax.engine.speculative import choose_k, expected_tokens

    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == 5 and expected_tokens(0.5, 1) == 1.5
    assert choose_k(0.05, (1, 2, 4, 7), 0.5) == 1      # drafts rarely kept: the least drafting
    assert choose_k(0.95, (1, 2, 4, 7), 0.1) == 7      # cheap, reliable drafts: the most
    assert choose_k(0.3, (2, 4, 7), 0.0) == 7          # free drafts (prompt lookup) never cost time


@pytest.mark.slow
def test_draft_tokens_adapt_per_dispatch(tiny, drafts):
    """Candidates (1, 4): the Q4_0 copy starts at K = 1 (acceptance unknown, its steps cost half
    the target's) and moves to K = 4 once its drafts are seen to be kept; the output stays plain
    greedy's."""
    cfg, params = tiny
    dcfg, dparams = drafts["self_q4_0"]
    stats, out = SpeculativeStats(), []
    for new in speculative_ids(cfg, params, init_cache(cfg, 1, 128), REPEATING, max_new_tokens=30,
                               sp=SamplingParams.make(1), drafter=ModelDrafter(dcfg), draft_params=dparams,
                               draft_cache=init_cache(dcfg, 1, 128), draft_tokens=(1, 4), rounds_per_dispatch=2,
                               stats=stats):
        out += new
    assert out == _greedy(cfg, params, REPEATING, 30, 128)
    assert stats.k_used[0] == 1 and 4 in stats.k_used, stats.k_used
