"""The serving engine's prefix cache and chunked prefill: the same greedy tokens with the cache on
and off (shared system prompts of page-aligned and unaligned lengths, multi-turn conversations,
several page sizes, a pool too small to keep every prefix), shared pages never written,
refcounts back to zero when idle, and long prompts prefilled in chunks between other streams'
decode dispatches (small synthetic model on the CPU; the 32-request check on the real default
model)."""
from __future__ import annotations

import numpy as np
import pytest

from rjax.runtime.serving import ServingConfig, ServingEngine

MAX_NEW = 6


def _config(page_size=8, prefix_cache=True, **kw):
    base = dict(n_slots=8, max_len=256, page_size=page_size, steps_per_dispatch=4, prefill_buckets=(4,),
                max_prefill_tokens=256, prefix_cache=prefix_cache)
    base.update(kw)
    return ServingConfig(**base)


def _run(cfg, params, config, prompts, max_new=MAX_NEW, engine=None):
    """Every prompt through one engine (new, or `engine` reused); -> ([tokens per prompt], engine)."""
    eng = engine or ServingEngine(cfg, params, config)
    ids = [eng.submit(p, max_new_tokens=max_new) for p in prompts]
    done = {e.request_id: e.completion.tokens for e in eng.run() if e.finished}
    return [done[i] for i in ids], eng


def _check_idle(eng):
    p = eng.pages
    assert eng.n_running == 0 and eng.n_queued == 0
    assert p.n_held == 0 and not p.refs.any() and p.n_free + p.n_cached == p.n_pages
    assert not eng.scheduler.computing
    np.testing.assert_array_equal(np.asarray(eng.cache.lengths), 0)


def _shared_workload(vocab, n, system_lengths, seed=0):
    rng = np.random.default_rng(seed)
    systems = [list(rng.integers(0, vocab, k)) for k in system_lengths]
    return [systems[i % len(systems)] + list(rng.integers(0, vocab, int(rng.integers(1, 12)))) for i in range(n)]


@pytest.mark.parametrize("page_size", [8, 16])
def test_shared_system_prompts_same_tokens_on_and_off(tiny, page_size):
    cfg, params = tiny
    prompts = _shared_workload(cfg.vocab_size, 24, (32, 45, 7), seed=page_size)
    off, _ = _run(cfg, params, _config(page_size, prefix_cache=False), prompts)
    on, eng = _run(cfg, params, _config(page_size), prompts)
    assert on == off
    stats = eng.prefix_stats
    # After the first of each, the 7 other prompts of the 32- and 45-token system prompts share
    # the system prompt's full pages (the 7-token one has none).
    assert stats.hits >= 14 and stats.tokens_saved >= 7 * (32 // page_size + 45 // page_size) * page_size
    _check_idle(eng)


def test_multi_turn_conversation_reuses_the_reply(tiny):
    """Turn 2 is turn 1's prompt, its reply and a new message: its prefix, generated tokens
    included, comes from the cache."""
    cfg, params = tiny
    rng = np.random.default_rng(5)
    firsts = [list(rng.integers(0, cfg.vocab_size, 30)) for _ in range(4)]
    results = {}
    for on in (False, True):
        config = _config(prefix_cache=on)
        t1, eng = _run(cfg, params, config, firsts, max_new=20)
        seconds = [p + r + [7, 8, 9] for p, r in zip(firsts, t1)]
        saved = eng.prefix_stats.tokens_saved if on else 0
        t2, eng = _run(cfg, params, config, seconds, engine=eng)
        results[on] = (t1, t2)
        if on:
            # 30 + 20 positions held per conversation: 6 full pages of 8 to share.
            assert eng.prefix_stats.tokens_saved - saved == 4 * 6 * 8
            _check_idle(eng)
    assert results[True] == results[False]


def test_shared_pages_are_never_written(tiny):
    """The content of every page two slots hold at once is the same when they have finished."""
    cfg, params = tiny
    prompts = _shared_workload(cfg.vocab_size, 8, (40,), seed=3)
    eng = ServingEngine(cfg, params, _config())
    for p in prompts:
        eng.submit(p, max_new_tokens=12)
    seen = {}
    while eng.has_work:
        eng.step()
        for page in np.flatnonzero(eng.pages.refs > 1):
            seen.setdefault(int(page), (np.asarray(eng.cache.k[:, page]).copy(), np.asarray(eng.cache.v[:, page]).copy()))
    assert len(seen) == 40 // 8
    for page, (k, v) in seen.items():
        np.testing.assert_array_equal(np.asarray(eng.cache.k[:, page]), k)
        np.testing.assert_array_equal(np.asarray(eng.cache.v[:, page]), v)
    _check_idle(eng)


def test_eviction_under_a_small_pool_keeps_outputs(tiny):
    """A pool that holds the running requests but not every cached prefix: old prefixes are
    evicted, every request completes, and the tokens are those without a cache."""
    cfg, params = tiny
    prompts = _shared_workload(cfg.vocab_size, 32, (24, 40, 33, 17, 50, 29), seed=9)
    small = dict(n_slots=4, n_pages=40, max_len=128)
    off, _ = _run(cfg, params, _config(prefix_cache=False, **small), prompts)
    on, eng = _run(cfg, params, _config(**small), prompts)
    assert on == off
    assert eng.prefix_stats.evictions > 0 and eng.prefix_stats.hits > 0
    _check_idle(eng)


def test_long_prompt_in_chunks_while_others_decode(tiny):
    """A prompt four chunks long: the same tokens as one prefill of the whole prompt, and the
    requests already running get tokens in every step of its prefill."""
    cfg, params = tiny
    rng = np.random.default_rng(11)
    long = list(rng.integers(0, cfg.vocab_size, 200))
    short = [list(rng.integers(0, cfg.vocab_size, 5)) for _ in range(3)]
    want, _ = _run(cfg, params, _config(prefix_cache=False), [long], max_new=8)
    eng = ServingEngine(cfg, params, _config(max_prefill_tokens=64, prefix_cache=False))
    ids = [eng.submit(p, max_new_tokens=40) for p in short]
    eng.step()
    long_id = eng.submit(long, max_new_tokens=8)
    steps_until_first, tokens, others_during = 0, {}, []
    while eng.has_work:
        events = eng.step()
        for e in events:
            tokens.setdefault(e.request_id, []).extend(e.tokens)
        if long_id not in tokens:
            steps_until_first += 1
            others_during.append(sum(len(e.tokens) for e in events if e.request_id in ids))
    assert tokens[long_id] == want[0]
    assert steps_until_first == 200 // 64   # chunks of 64, 64, 64; the last (8) samples in step 4
    assert all(n > 0 for n in others_during), others_during


@pytest.mark.slow
def test_32_requests_on_the_default_model(smollm2):
    """The real default model: 32 requests over two system prompts (page-aligned 64 tokens and
    unaligned 77), 4 of them two-turn conversations: greedy tokens equal with the cache on and
    off (other page sizes: the tests above). Two waves of the 16 slots, each system prompt cached
    by its first request and shared by the others."""
    cfg, params, tok = smollm2.config, smollm2.params, smollm2.tokenizer
    text = ("You are a careful assistant. Answer briefly and precisely, cite the facts you use, and say "
            "when you do not know. ") * 8
    ids = tok.encode(text)
    systems = [ids[:64], ids[3:80]]
    questions = [tok.encode(f" Question {i}: what is {i} plus {i * 3}?") for i in range(28)]
    prompts = [systems[i % 2] + q for i, q in enumerate(questions)]
    convs = [systems[i % 2] + tok.encode(f" Tell me about the number {i}.") for i in range(4)]
    results = {}
    for page_size, on in ((16, False), (16, True)):
        config = ServingConfig(n_slots=16, max_len=256, page_size=page_size, steps_per_dispatch=8,
                               prefill_buckets=(1, 4, 8), max_prefill_tokens=1024, prefix_cache=on)
        first, eng = _run(cfg, params, config, prompts + convs, max_new=8)
        second, eng = _run(cfg, params, config, [c + r + tok.encode(" And its square?")
                                                 for c, r in zip(convs, first[28:])], max_new=8, engine=eng)
        results[(page_size, on)] = first + second
        if on:
            assert eng.prefix_stats.hits >= 28
            _check_idle(eng)
    assert results[(16, True)] == results[(16, False)]
