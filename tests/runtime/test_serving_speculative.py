"""The serving engine drafting with a draft model (ServingConfig(speculative="model"), the draft
model's own cache beside the target's): greedy outputs token for token plain greedy decoding's,
paged and contiguous, with slots reused, a prefix-cache hit, and requests asking for
log-probabilities (decoded plainly while the draft cache stands by, which then catches up);
drafted and accepted counts; the configurations it refuses; precompiling its programs;
rjax.generate of a list of prompts (and serve_ids) with a draft model."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rjax.engine import steps
from rjax.math.cache import init_cache
from rjax.runtime.scheduler import all_greedy
from rjax.runtime.serving import ServingConfig, ServingEngine

REPEATING = [5, 6, 7, 8, 9, 10] * 3 + [5, 6]
PLAIN = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38]
LONG = [int(t) for t in np.random.default_rng(5).integers(1, 500, 40)]   # two full pages and more


def _greedy(cfg, params, prompt, n, max_len):
    cache = init_cache(cfg, 1, max_len)
    t, l = steps.pad_prompts([prompt])
    logits, cache = steps.prefill(cfg, params, cache, jnp.asarray(t), jnp.asarray(l))
    out = [int(jnp.argmax(logits[0]))]
    while len(out) < n and len(prompt) + len(out) <= max_len:
        logits, cache = steps.decode_step(cfg, params, cache, jnp.asarray([out[-1]], jnp.int32))
        out.append(int(jnp.argmax(logits[0])))
    return out


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """An unrelated one-layer model of the tiny model's vocabulary: its drafts are mostly rejected."""
    from rjax.loading.loaders.gguf import load_gguf
    from rjax.loading.synth import write_synthetic

    path = write_synthetic(tmp_path_factory.mktemp("synth") / "other.gguf", "smollm2-135m", "q8_0", seed=4,
                           n_layers=1, vocab_size=512, tokenizer_from="builtin")
    cfg, params, _ = load_gguf(path, progress=False)
    return cfg, params


def _run(eng, requests):
    """Submit (prompt, max_new_tokens, logprobs) requests, run them all -> completions in order."""
    ids = [eng.submit(p, max_new_tokens=n, logprobs=lp) for p, n, lp in requests]
    done = {e.request_id: e.completion for e in eng.run() if e.finished}
    return [done[i] for i in ids]


def test_self_draft_paged_equals_plain_greedy_and_accepts_nearly_everything(tiny):
    """The target as its own draft model over a paged cache: 5 requests through 2 slots, one
    asking for log-probabilities (every other slot decodes plainly meanwhile, and its draft cache
    then catches up), then a second wave whose long prompt shares the first's cached pages (the
    draft's pages of that prefix are shared with the target's). Each output is plain greedy's,
    and the draft's proposals are kept nearly always (a draft cache that fell behind or shared
    a wrong page would propose other tokens)."""
    cfg, params = tiny
    S = 96
    config = ServingConfig(n_slots=2, max_len=S, page_size=16, steps_per_dispatch=3, speculative="model",
                           draft_tokens=3)
    eng = ServingEngine(cfg, params, config, draft=(cfg, params))
    first = [(REPEATING, 20, False), (PLAIN, 13, True), (LONG, 12, False), (REPEATING[3:], 9, False),
             (PLAIN[::-1] * 2, 17, False)]
    second = [(LONG[:36] + PLAIN[:5], 20, False), (REPEATING + PLAIN, 4, True)]
    got = _run(eng, first) + _run(eng, second)
    for (prompt, n, _), c in zip(first + second, got):
        assert c.tokens == _greedy(cfg, params, prompt, n, S), prompt
    assert eng.prefix_stats.hits > 0
    drafted, accepted = eng.speculative_stats["drafted"], eng.speculative_stats["accepted"]
    assert drafted == sum(c.drafted for c in got) and accepted == sum(c.accepted for c in got)
    assert drafted > 30 and accepted >= 0.9 * drafted, (accepted, drafted)
    assert got[1].logprobs is not None and len(got[1].logprobs) == 13


def test_other_draft_contiguous_equals_plain_greedy(tiny, other):
    """A draft model that mostly disagrees, over a contiguous cache: 6 requests through 3 slots
    (budgets ending inside a round, a log-probabilities request mixed in, one sampled request):
    the greedy outputs are plain greedy's, rejections happened, and every count adds up."""
    cfg, params = tiny
    S = 64
    config = ServingConfig(n_slots=3, max_len=S, page_size=None, steps_per_dispatch=3, speculative="model",
                           draft_tokens=4)
    eng = ServingEngine(cfg, params, config, draft=other)
    requests = [(REPEATING, 18, False), (PLAIN, 11, False), (REPEATING[3:], 2, True), (PLAIN[::-1] * 2, 15, False),
                (REPEATING + PLAIN, 7, True), (REPEATING[:7], 1, False)]
    got = _run(eng, requests)
    for (prompt, n, _), c in zip(requests, got):
        assert c.tokens == _greedy(cfg, params, prompt, n, S), prompt
        assert 0 <= c.accepted <= c.drafted
    totals = eng.speculative_stats
    assert 0 < totals["drafted"] and totals["accepted"] < totals["drafted"]
    rid = eng.submit(PLAIN, max_new_tokens=12, temperature=0.8, top_k=20, seed=1)
    done = {e.request_id: e.completion for e in eng.run() if e.finished}
    assert len(done[rid].tokens) == 12 and all(0 <= t < cfg.vocab_size for t in done[rid].tokens)


def test_draft_model_configuration_errors(tiny, tmp_path):
    from rjax.loading.loaders.gguf import load_gguf
    from rjax.loading.synth import write_synthetic

    cfg, params = tiny
    config = ServingConfig(n_slots=2, max_len=64, speculative="model")
    with pytest.raises(ValueError, match=r"speculative='model' needs the draft model"):
        ServingEngine(cfg, params, config)
    with pytest.raises(ValueError, match=r"draft: a draft model is given but ServingConfig.speculative is 'ngram'"):
        ServingEngine(cfg, params, ServingConfig(n_slots=2, max_len=64, speculative="ngram"), draft=(cfg, params))
    with pytest.raises(TypeError, match="draft must be a"):
        ServingEngine(cfg, params, config, draft=params)
    path = write_synthetic(tmp_path / "v1024.gguf", "smollm2-135m", "q8_0", seed=1, n_layers=1, vocab_size=1024,
                           tokenizer_from="builtin")
    big_cfg, big_params, _ = load_gguf(path, progress=False)
    with pytest.raises(ValueError, match="vocabulary of 1,024 tokens, the target 512"):
        ServingEngine(cfg, params, config, draft=(big_cfg, big_params))
    short = dataclasses.replace(cfg, context_length=32)
    with pytest.raises(ValueError, match="draft: the draft model's context of 32 tokens"):
        ServingEngine(cfg, params, config, draft=(short, params))
    with pytest.raises(ValueError, match=r"ServingConfig.speculative must be one of \(None, 'ngram', 'model'\)"):
        ServingConfig(speculative="self:q4_0")
    # The draft model's cache is counted beside the target's.
    plain = ServingEngine(cfg, params, ServingConfig(n_slots=2, max_len=64))
    assert ServingEngine(cfg, params, config, draft=(cfg, params)).kv_bytes == 2 * plain.kv_bytes


@pytest.mark.slow
def test_precompile_covers_the_draft_programs(tiny):
    """After precompile(logprobs=True), serving with a draft model (its prefill, the speculative
    dispatch, the catch-up after a log-probabilities request) compiles none of them again."""
    from tests.engine.test_precompile import count_compiles

    cfg, params = tiny
    config = ServingConfig(n_slots=2, max_len=64, page_size=16, steps_per_dispatch=3, speculative="model",
                           draft_tokens=3, prefill_buckets=(1, 2), max_prefill_tokens=32)
    eng = ServingEngine(cfg, params, config, draft=(cfg, params))
    report = eng.precompile(logprobs=True)
    names = set(report.compile_s)
    # Catch-up calls of one slot take the program of a one-prompt prefill chunk of 16.
    assert {"speculative B=1 K=3 N=3", "speculative B=2 K=3 N=3", "draft prefill P=1 T=16", "draft prefill P=2 T=16",
            "draft prefill P=1 T=32"} <= names and "draft catch-up P=1 T=16" not in names, names
    with count_compiles() as compiles:
        got = _run(eng, [(REPEATING, 12, False), (PLAIN, 5, True), (PLAIN[::-1] * 2, 9, False)])
    assert [c.tokens for c in got] == [_greedy(cfg, params, p, n, 64) for p, n in ((REPEATING, 12), (PLAIN, 5),
                                                                                   (PLAIN[::-1] * 2, 9))]
    assert not {"jit(speculative_dispatch)", "jit(draft_prefill)", "jit(prefill_into_slots)",
                "jit(decode_dispatch)"} & set(compiles), compiles


def test_serve_cli_loads_a_draft_model(tiny_path):
    """`rjax serve --speculative`: 'ngram' as before; 'self:q8_0' (or a model) loaded as
    generation.load_drafter loads it, for an engine of speculative='model'; a bad name refused."""
    from rjax.cli.main import build_parser
    from rjax.engine.speculative import ModelDrafter, NgramDrafter
    from rjax.server.cli import make_setup

    assert build_parser().parse_args(["serve", "--speculative", "self:q4_0"]).speculative == "self:q4_0"
    kw = dict(model_id="tiny", slots=2, max_len=64, steps_per_dispatch=4, chat_template=None, precompile=False)
    eng = make_setup(str(tiny_path), speculative="ngram", **kw)().make_engine()
    assert eng.config.speculative == "ngram" and isinstance(eng.drafter, NgramDrafter) and eng.draft_cache is None
    eng = make_setup(str(tiny_path), speculative="self:q8_0", **kw)().make_engine()
    assert eng.config.speculative == "model" and isinstance(eng.drafter, ModelDrafter)
    assert eng.draft_cache.paged and eng.draft_cache.n_pages == eng.cache.n_pages
    with pytest.raises(ValueError, match="self:q4_0"):
        make_setup(str(tiny_path), speculative="self:q2_k", **kw)()


def test_sampled_slots_are_distributed_as_plain_sampling():
    """One speculative dispatch over 20,000 slots of a vocabulary-4 model, each slot its own
    random stream, a perturbed copy drafting for all of them at once: the joint frequencies of
    the first 5 tokens match exact plain sampling (chi-square), drafts accepted and rejected."""
    from scipy import stats as scipy_stats
    from tests.engine.test_speculative import _exact_joint, _small_model

    from rjax.engine.slots import init_slots
    from rjax.engine.speculative import ModelDrafter, speculative_dispatch
    from rjax.engine.steps import DecodeState
    from rjax.math.model import forward
    from rjax.math.sampling import SamplingParams, sample

    cfg, params = _small_model(0)
    dcfg, dparams = _small_model(1, base=params, noise=0.5)
    prompt, n, N, S, k = [0, 1, 2, 3, 0, 1], 5, 20_000, 16, 3
    tokens = jnp.asarray([prompt] * N, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(len(prompt)), tokens.shape)
    logits, cache = forward(cfg, params, init_cache(cfg, N, S), tokens, pos)
    _, dcache = forward(dcfg, dparams, init_cache(dcfg, N, S), tokens, pos)
    cache, dcache = (dataclasses.replace(c, lengths=jnp.full((N,), len(prompt), jnp.int32)) for c in (cache, dcache))
    sp = SamplingParams.make(N, 0.8, 3, 0.9)
    pair = jax.vmap(jax.random.split)(jax.random.split(jax.random.key(7), N))
    first = jax.vmap(lambda lg, key: sample(lg[None], key, SamplingParams.make(1, 0.8, 3, 0.9))[0])(
        logits[:, -1], pair[:, 0])
    first_host = np.asarray(first)   # the slots are donated to the dispatch
    slots = dataclasses.replace(init_slots(N, 1, cfg.vocab_size), sampling=sp, state=DecodeState(
        first, jnp.zeros(N, bool), jnp.full((N,), n - 1, jnp.int32), pair[:, 1]))
    out, drafted, accepted, _, _, _ = speculative_dispatch(cfg, params, cache, slots, ModelDrafter(dcfg), dparams,
                                                           (dcache, jnp.full((N,), -1, jnp.int32)), k, n)
    out = np.asarray(out)
    seqs = np.concatenate([first_host[:, None],
                           np.stack([row[row >= 0][: n - 1] for row in out])], axis=1)
    drafted, accepted = int(np.sum(drafted)), int(np.sum(accepted))
    assert 0.1 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    want = _exact_joint(cfg, params, prompt, n, SamplingParams.make(1, 0.8, 3, 0.9)).ravel() * N
    got = np.bincount(np.ravel_multi_index(seqs.T, [cfg.vocab_size] * n), minlength=want.size)
    assert got[want == 0].sum() == 0
    big = want >= 5
    obs = np.append(got[big], got[~big & (want > 0)].sum())
    exp = np.append(want[big], want[~big & (want > 0)].sum())
    p = scipy_stats.chisquare(obs[exp > 0], exp[exp > 0] * obs.sum() / exp.sum()).pvalue
    assert p > 1e-4, p


def test_generate_a_list_with_a_draft_model(tiny_path):
    """rjax.generate(model, [prompts], speculative=<a draft model>): the list runs through the
    serving engine drafting with that model (here the loaded target itself, then 'self:q8_0'
    through serve_ids); every result is token for token the one-prompt plain result, reports
    its own drafted and accepted counts (a self draft keeps nearly all) and names the drafter."""
    import rjax
    from rjax.runtime.generation import serve_ids

    model = rjax.load(tiny_path, progress=False)
    texts = ["abcabcabcabc", "the cat sat on the mat", "xyzxyzxy"]
    plain = [rjax.generate(model, t, raw=True, max_new_tokens=14) for t in texts]
    got = rjax.generate(model, texts, raw=True, max_new_tokens=14, speculative=model, draft_tokens=3, n_slots=2)
    for p, r in zip(plain, got):
        assert (r.tokens, r.text, r.finish_reason) == (p.tokens, p.text, p.finish_reason)
        assert r.speculative["drafter"] == model.name
        assert 0 <= r.speculative["accepted"] <= r.speculative["drafted"] and r.speculative["drafted"] > 0
    drafted, accepted = sum(r.speculative["drafted"] for r in got), sum(r.speculative["accepted"] for r in got)
    assert accepted >= 0.9 * drafted, (accepted, drafted)
    ids = [r.prompt_tokens for r in plain]
    done = serve_ids(model, ids, max_new_tokens=14, speculative="self:q8_0", draft_tokens=3, n_slots=2)
    assert [c.tokens for c in done] == [p.tokens for p in plain]
    assert sum(c.accepted for c in done) >= 0.9 * sum(c.drafted for c in done) > 0
    with pytest.raises(ValueError, match="draft_tokens='auto' is for one prompt"):
        rjax.generate(model, texts, raw=True, speculative=model, draft_tokens="auto")


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_greedy_and_sampled_requests_share_a_dispatch(tiny, drafter):
    """A sampled request beside greedy ones makes the engine run the general speculative program,
    whose greedy slots still decode exactly as plain greedy; with greedy requests alone it runs
    the program that holds no sampling (no filters over the vocabulary)."""
    from rjax.engine.speculative import speculative_dispatch

    cfg, params = tiny
    S = 64
    config = ServingConfig(n_slots=3, max_len=S, page_size=16, steps_per_dispatch=1, speculative=drafter,
                           draft_tokens=3)
    eng = ServingEngine(cfg, params, config, draft=(cfg, params) if drafter == "model" else None)
    requests = [(REPEATING, 30, 0.0), (PLAIN, 30, 0.9), (PLAIN[::-1] * 2, 30, 0.0)]
    ids = [eng.submit(p, max_new_tokens=n, temperature=t, seed=5) for p, n, t in requests]
    events, mixed = [], 0
    while eng.has_work:
        events += eng.step()
        temperatures = {r.request.temperature for r in eng.scheduler.running.values()}
        mixed += len(temperatures) > 1 and not all_greedy(eng.scheduler.running.values())
    assert mixed
    done = {e.request_id: e.completion for e in events if e.finished}
    for (p, n, t), i in zip(requests, ids):
        assert len(done[i].tokens) == n
        if t == 0:
            assert done[i].tokens == _greedy(cfg, params, p, n, S), p
    B, k = 2, 3
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    draft = (eng.draft_cache, eng.pending) if drafter == "model" else (i32(B, S + 1), i32(B))
    text = {g: speculative_dispatch.trace(cfg, params, eng.cache, eng.slots, eng.drafter, eng.draft_params, draft, k, 2,
                                          i32(B), g).lower().as_text() for g in (False, True)}
    assert "@filtered_logits" in text[False] and "@filtered_logits" not in text[True]
    # No conditional on the temperature in either (the draft model's one on pending tokens is in both).
    cases = {g: t.count("stablehlo.case") for g, t in text.items()}
    assert cases[True] == cases[False] and (drafter == "model" or cases[True] == 0)
