"""Continuous batching: many requests through few slots give, token for token, what each prompt
gives alone; arrivals mid-decode, slot reuse, page-limited admission, per-request settings,
limits, memory fit, and `rjax.generate` over a list (small synthetic model on the CPU; one slow
check on the real default model).

The reference for "alone" is an independent route through the engine: one prompt in a one-slot
contiguous cache, `engine.prefill` then `engine.decode_step` with argmax on the host.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rjax
from rjax.engine import steps, slots
from rjax.engine.memory import MemoryFitError, kv_bytes_per_position, plan_memory
from rjax.engine.slots import free_slots
from rjax.engine.steps import ContextLengthError
from rjax.math.cache import init_cache
from rjax.runtime.scheduler import all_greedy, sampling_variant
from rjax.runtime.serving import ServingConfig, ServingEngine
from rjax.runtime.serving_limits import fit_config

# One engine geometry for most tests, so they share compiled programs: 8 slots of 64 positions
# over a pool of 24 pages of 8 (fewer than 8 full slots need: long requests wait for pages).
CONFIG = ServingConfig(n_slots=8, max_len=64, page_size=8, n_pages=24, steps_per_dispatch=4, prefill_buckets=(4,))


@pytest.fixture(scope="module")
def alone(tiny):
    """alone(prompt, n) -> the first n greedy tokens of the prompt run by itself (memoized)."""
    cfg, params = tiny

    @functools.lru_cache(maxsize=None)
    def run(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
        cache = init_cache(cfg, 1, CONFIG.max_len)
        t, l = steps.pad_prompts([list(prompt)])
        logits, cache = steps.prefill(cfg, params, cache, jnp.asarray(t), jnp.asarray(l))
        out = [int(jnp.argmax(logits[0]))]
        while len(out) < n and len(prompt) + len(out) <= CONFIG.max_len:
            logits, cache = steps.decode_step(cfg, params, cache, jnp.asarray([out[-1]], jnp.int32))
            out.append(int(jnp.argmax(logits[0])))
        return tuple(out)

    return lambda prompt, n: list(run(tuple(int(t) for t in prompt), n))


def _prompts(seed, n, vocab, lo=2, hi=16):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, vocab, int(k))) for k in rng.integers(lo, hi + 1, n)]


def _drain(eng: ServingEngine, submit_at: dict[int, list] | None = None):
    """Step to the end; submit_at[i] = [(prompt, kwargs), ...] are submitted before step i.
    -> ({request_id: completion}, {request_id: streamed tokens}, most requests running at once)."""
    submit_at = dict(submit_at or {})
    completions, streamed, most, i = {}, {}, 0, 0
    while eng.has_work or submit_at:
        for prompt, kw in submit_at.pop(i, []):
            eng.submit(prompt, **kw)
        for e in eng.step():
            streamed.setdefault(e.request_id, []).extend(e.tokens)
            if e.finished:
                assert e.request_id not in completions
                completions[e.request_id] = e.completion
        most = max(most, eng.n_running)
        i += 1
    return completions, streamed, most


def _check_idle(eng: ServingEngine):
    """Everything was given back: all slots free, no page held (free, or kept by the prefix
    cache), every refcount and length 0."""
    assert eng.n_running == 0 and eng.n_queued == 0
    assert eng.pages.n_held == 0 and eng.pages.unreserved == eng.pages.n_pages
    assert eng.pages.n_free + eng.pages.n_cached == eng.pages.n_pages and not eng.pages.refs.any()
    assert (eng.pages.tables == -1).all()
    np.testing.assert_array_equal(np.asarray(eng.cache.lengths), 0)
    np.testing.assert_array_equal(np.asarray(eng.cache.block_tables), -1)


def test_32_prompts_through_8_slots_equal_each_prompt_alone(tiny, alone):
    cfg, params = tiny
    prompts = _prompts(0, 32, cfg.vocab_size)
    budgets = [3 + i % 10 for i in range(32)]
    eng = ServingEngine(cfg, params, CONFIG)
    ids = [eng.submit(p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
    running, slots_used = [], set()
    completions, streamed = {}, {}
    while eng.has_work:
        for e in eng.step():
            streamed.setdefault(e.request_id, []).extend(e.tokens)
            if e.finished:
                completions[e.request_id] = e.completion
        running.append(eng.n_running)
        slots_used |= set(eng.scheduler.running)
        # The host's view of each running sequence matches the device cache, page for page (with a
        # dispatch launched ahead, the device is up to its steps further).
        lengths, tables = np.asarray(eng.cache.lengths), np.asarray(eng.cache.block_tables)
        ahead = CONFIG.steps_per_dispatch if eng.runs_ahead else 0
        for s, r in eng.scheduler.running.items():
            assert r.length <= lengths[s] <= r.length + ahead and (tables[s] == eng.pages.tables[s]).all()
    assert max(running) <= CONFIG.n_slots and slots_used <= set(range(CONFIG.n_slots))
    for rid, p, b in zip(ids, prompts, budgets):
        c = completions[rid]
        assert c.tokens == alone(p, b), f"request {rid} (prompt of {len(p)}, budget {b})"
        assert streamed[rid] == c.tokens and c.finish_reason == "length" and c.prompt == p
    _check_idle(eng)


def test_256_slots(tiny, alone):
    cfg, params = tiny
    config = ServingConfig(n_slots=256, max_len=32, page_size=8, steps_per_dispatch=2, prefill_buckets=(128,),
                           max_prefill_tokens=128 * 16)
    prompts = _prompts(6, 270, cfg.vocab_size, lo=1, hi=12)
    eng = ServingEngine(cfg, params, config)
    ids = [eng.submit(p, max_new_tokens=6 + i % 3) for i, p in enumerate(prompts)]
    done, _, most = _drain(eng)
    assert most == 256  # two prefill calls of 128 fill every slot; the last 14 requests reuse slots
    assert all(len(done[rid].tokens) == 6 + i % 3 for i, rid in enumerate(ids))
    # Every 4th request and every one that reused a slot, against the prompt alone.
    for i in [*range(0, 256, 4), *range(256, 270)]:
        assert done[ids[i]].tokens == alone(prompts[i], 6 + i % 3), f"request {ids[i]}"
    _check_idle(eng)


def test_arrivals_while_others_decode_and_per_request_settings(tiny, alone):
    cfg, params = tiny
    prompts = _prompts(1, 14, cfg.vocab_size)
    stop_tok = alone(prompts[3], 10)[4]  # request 3 stops at (the first occurrence of) this token
    sampled = dict(temperature=0.9, top_k=20, top_p=0.8)
    plan = {0: [(p, dict(max_new_tokens=10)) for p in prompts[:3]],
            1: [(prompts[3], dict(max_new_tokens=10, stop_ids=[stop_tok], request_id="stopper")),
                (prompts[4], dict(max_new_tokens=10, request_id="hot", **sampled))],
            3: [(p, dict(max_new_tokens=7)) for p in prompts[5:11]],
            4: [(p, dict(max_new_tokens=12, request_id=f"late{i}")) for i, p in enumerate(prompts[11:])]}
    eng = ServingEngine(cfg, params, CONFIG)
    completions, streamed, _ = _drain(eng, plan)
    assert len(completions) == 14
    for rid, p in zip(range(3), prompts[:3]):
        assert completions[rid].tokens == alone(p, 10)
    for rid, p in zip(range(3, 9), prompts[5:11]):
        assert completions[rid].tokens == alone(p, 7)
    for i, p in enumerate(prompts[11:]):
        assert completions[f"late{i}"].tokens == alone(p, 12)
    ref = alone(prompts[3], 10)
    c = completions["stopper"]
    assert c.finish_reason == "stop" and c.tokens == ref[: ref.index(stop_tok) + 1]
    hot = completions["hot"]
    assert len(hot.tokens) == 10 and all(0 <= t < cfg.vocab_size for t in hot.tokens)
    assert all(streamed[r] == completions[r].tokens for r in completions)
    _check_idle(eng)


def test_settings_slots_and_lengths_are_data_not_recompilations(tiny):
    """New prompts, slots, sampling settings and stop ids compile nothing new once the engine's
    geometry has run once (a warm-up here, so the test does not depend on test order)."""
    cfg, params = tiny

    def run(seed, settings):
        eng = ServingEngine(cfg, params, CONFIG)
        for i, p in enumerate(_prompts(seed, 6, cfg.vocab_size)):
            eng.submit(p, max_new_tokens=5, stop_ids=[i, i + 1], **settings(i))
        _drain(eng)
        return eng

    warm = ServingEngine(cfg, params, CONFIG)
    for i, p in enumerate(_prompts(1, 8, cfg.vocab_size)):  # running counts 8 down to 1: every decode bucket
        warm.submit(p, max_new_tokens=2 + 2 * i)
    _drain(warm)
    run(3, lambda i: dict(temperature=0.5, top_k=1 + i, top_p=0.9))  # the sampling program, with filters
    before = (slots.prefill_into_slots.compiled_count(), slots.decode_dispatch.compiled_count())
    eng = run(2, lambda i: dict(temperature=0.3 * i, top_k=i, top_p=1.0 - 0.1 * i))
    assert (slots.prefill_into_slots.compiled_count(), slots.decode_dispatch.compiled_count()) == before
    _check_idle(eng)


def test_requests_wait_for_pages_and_still_match(tiny, alone):
    """Each request may need 63 positions (8 pages): the pool of 24 runs 3 at a time, though 8
    slots are free; the rest wait in the queue and nobody runs out of pages mid-sequence."""
    cfg, params = tiny
    prompts = _prompts(3, 7, cfg.vocab_size, lo=16, hi=16)
    eng = ServingEngine(cfg, params, CONFIG)
    ids = [eng.submit(p, max_new_tokens=48) for p in prompts]
    most = 0
    completions = {}
    while eng.has_work:
        for e in eng.step():
            if e.finished:
                completions[e.request_id] = e.completion
        most = max(most, eng.n_running)
        assert eng.pages.n_free >= 0 and eng.pages.unreserved >= 0
    assert most == 3
    for rid, p in zip(ids, prompts):
        assert completions[rid].tokens == alone(p, 48) and completions[rid].finish_reason == "length"
    _check_idle(eng)


def test_a_request_may_fill_max_len_and_no_more(tiny, alone):
    cfg, params = tiny
    p = _prompts(4, 1, cfg.vocab_size, lo=14, hi=14)[0]
    eng = ServingEngine(cfg, params, CONFIG)
    with pytest.raises(ContextLengthError, match=r"prompt of 14 tokens and max_new_tokens 51: 65 positions, beyond "
                                                 r"ServingConfig.max_len of 64 \(max_new_tokens can be at most 50\)"):
        eng.submit(p, max_new_tokens=51)
    assert not eng.has_work
    rid = eng.submit(p, max_new_tokens=50)
    (c,) = [e.completion for e in eng.run() if e.finished]
    # 14 prompt positions + 49 written tokens; the 50th token is sampled but never written.
    assert c.request_id == rid and c.finish_reason == "length" and len(c.tokens) == 50
    assert c.tokens == alone(p, 50)
    _check_idle(eng)


def test_contiguous_cache_engine_gives_the_same_tokens(tiny, alone):
    cfg, params = tiny
    config = ServingConfig(n_slots=4, max_len=64, page_size=None, steps_per_dispatch=4, prefill_buckets=(4,))
    prompts = _prompts(5, 10, cfg.vocab_size)
    eng = ServingEngine(cfg, params, config)
    ids = [eng.submit(p, max_new_tokens=6) for p in prompts]
    done = {e.request_id: e.completion for e in eng.run() if e.finished}
    for rid, p in zip(ids, prompts):
        assert done[rid].tokens == alone(p, 6)
    np.testing.assert_array_equal(np.asarray(eng.cache.lengths), 0)


def test_free_slots_resets_only_the_given_rows(tiny):
    cfg, _ = tiny
    cache = init_cache(cfg, 4, 16)
    cache = cache.advance(None, jnp.asarray([3, 5, 7, 9], jnp.int32))
    k = np.asarray(cache.k)
    out = free_slots(cache, jnp.asarray([2, 0, 4, 4], jnp.int32))  # 4: padding
    np.testing.assert_array_equal(np.asarray(out.lengths), [0, 5, 0, 9])
    np.testing.assert_array_equal(np.asarray(out.k), k)


# --- limits and bad input ---------------------------------------------------------------------

def test_bad_requests_are_refused_and_change_nothing(tiny):
    cfg, params = tiny
    eng = ServingEngine(cfg, params, CONFIG, stop_ids=[2])
    cases = [
        (dict(prompt=list(range(64))), r"prompt of 64 tokens: ServingConfig.max_len is 64"),
        (dict(prompt=[]), "empty prompt"),
        (dict(prompt=[1, cfg.vocab_size]), r"prompt has token id 512 at position 1, outside the vocabulary \[0, 512\)"),
        (dict(prompt=[1, 2], max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
        (dict(prompt=[1, 2], temperature=-1.0), "temperature must be >= 0"),
        (dict(prompt=[1, 2], top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(prompt=[1, 2], stop_ids=list(range(9))), "9 stop ids; ServingConfig.max_stop_ids is 8"),
        (dict(prompt=[1, 2], stop_ids=[-4]), "stop_ids has token id -4 at position 0, outside the vocabulary"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            eng.submit(**kw)
    assert eng.n_queued == 0 and not eng.has_work and eng.step() == []
    eng.submit([1, 2], max_new_tokens=4, request_id="a")
    with pytest.raises(ValueError, match="request id 'a' is already queued or running"):
        eng.submit([3], max_new_tokens=4, request_id="a")
    assert eng.n_queued == 1


def test_config_limits_are_checked():
    with pytest.raises(ValueError, match="not a multiple of page_size 16"):
        ServingConfig(max_len=40, page_size=16)
    with pytest.raises(ValueError, match="power of two"):
        ServingConfig(page_size=12, max_len=48)
    with pytest.raises(ValueError, match="n_pages 3 cannot hold one sequence of max_len 64"):
        ServingConfig(max_len=64, page_size=16, n_pages=3)
    with pytest.raises(ValueError, match="n_slots must be >= 1"):
        ServingConfig(n_slots=0)
    with pytest.raises(ValueError, match="prefill_buckets"):
        ServingConfig(prefill_buckets=(4, 2))


def test_max_len_beyond_the_context_is_refused(tiny):
    cfg, params = tiny
    with pytest.raises(ValueError, match=f"exceeds the model's context length {cfg.context_length}"):
        ServingEngine(cfg, params, ServingConfig(max_len=cfg.context_length * 2))


# --- memory fit -------------------------------------------------------------------------------

def test_memory_plan_counts_pages_and_refuses_what_does_not_fit(tiny):
    cfg, _ = tiny
    per_pos = kv_bytes_per_position(cfg, np.float32)
    assert per_pos == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    MiB = 1 << 20
    small = dict(prefill_tokens=64, prefill_prompts=4)  # a small prefill workspace for a small budget
    avail = 64 * MiB
    plan = plan_memory(cfg, max_len=256, page_size=16, n_slots=8, available=avail, reserve_bytes=MiB,
                       params_bytes=2 * MiB, **small)
    left = avail - MiB - 2 * MiB - plan.workspace_bytes
    assert plan.n_pages == min(left // (16 * per_pos), 8 * 16)
    assert plan.needed_bytes <= avail and plan.kv_bytes == plan.n_pages * 16 * per_pos
    # Slots chosen from memory: as many as hold tokens_per_slot positions (4 pages) each.
    chosen = plan_memory(cfg, max_len=256, page_size=16, available=32 * MiB, reserve_bytes=0, tokens_per_slot=64,
                         **small)
    assert 1 < chosen.n_slots < 256 and chosen.n_pages >= chosen.n_slots * 4
    assert chosen.needed_bytes <= 32 * MiB
    more = plan_memory(cfg, max_len=256, page_size=16, available=32 * MiB, reserve_bytes=0, tokens_per_slot=64,
                       n_slots=chosen.n_slots + 1, **small)
    assert more.n_pages < (chosen.n_slots + 1) * 4
    with pytest.raises(MemoryFitError, match=r"needs [\d,]+ bytes .*params 50,000,000.*the given budget has "
                                             r"33,554,432 bytes available"):
        plan_memory(cfg, max_len=256, page_size=16, n_slots=4, available=32 * MiB, params_bytes=50_000_000,
                    reserve_bytes=0, **small)
    with pytest.raises(MemoryFitError, match=r"contiguous KV cache of 64 slots x 2048 positions"):
        plan_memory(cfg, max_len=2048, page_size=None, n_slots=64, available=32 * MiB, reserve_bytes=0, **small)
    with pytest.raises(MemoryFitError, match=r"one slot of 256 positions in pages of 16"):
        plan_memory(cfg, max_len=256, page_size=16, available=4 * MiB, reserve_bytes=0, **small)


def test_free_memory_counts_only_the_pools_largest_free_block():
    """A GPU allocator pool that once held a load's temporaries keeps them as free pieces; only
    its largest free piece, and the memory beyond the pool, can take a cache's large arrays."""
    from rjax.engine.memory import available_bytes

    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

        def __str__(self):
            return "gpu:0"

    G = 1 << 30
    plain = Device(dict(bytes_limit=80 * G, bytes_in_use=5 * G))
    assert available_bytes(plain) == (75 * G, "gpu:0 memory_stats")
    # 12 GiB pooled, 5 in use, the 7 free in pieces of at most 1.5 GiB: 68 + 1.5 usable.
    pooled = Device(dict(bytes_limit=80 * G, bytes_in_use=5 * G, pool_bytes=12 * G,
                         largest_free_block_bytes=3 * G // 2))
    assert available_bytes(pooled)[0] == 68 * G + 3 * G // 2
    whole = Device(dict(bytes_limit=80 * G, bytes_in_use=5 * G, pool_bytes=12 * G, largest_free_block_bytes=7 * G))
    assert available_bytes(whole)[0] == 75 * G


def test_engine_refuses_a_cache_that_does_not_fit_before_allocating(tiny):
    cfg, params = tiny
    with pytest.raises(MemoryFitError, match=r"paged KV cache of 4096 pages x 16 positions.*needs [\d,]+ bytes"):
        ServingEngine(cfg, params, ServingConfig(n_slots=256, max_len=256, page_size=16, n_pages=4096),
                      available_bytes=64 << 20)
    small = dict(max_prefill_tokens=64, prefill_buckets=(4,))
    config = fit_config(cfg, max_len=256, page_size=16, available=32 << 20, reserve_bytes=0, tokens_per_slot=64,
                        **small)
    assert config.n_slots > 1 and config.n_pages >= 4 * config.n_slots and config.max_prefill_tokens == 64
    assert fit_config(cfg, max_len=256, page_size=16, n_slots=2, available=32 << 20, reserve_bytes=0,
                      **small).n_slots == 2


# --- rjax.generate over a list ----------------------------------------------------------------

def test_generate_with_a_list_runs_through_serving_and_equals_each_prompt(tiny_path, alone):
    model = rjax.load(tiny_path, progress=False)
    prompts = ["hello there", "a b c d e f", "x", "the quick brown fox"]
    batch = rjax.generate(model, prompts, raw=True, max_new_tokens=6, n_slots=4)
    tok = model.tokenizer
    for p, r in zip(prompts, batch):
        assert r.prompt_tokens == tok.encode(p)
        expect = alone(r.prompt_tokens, 6)
        if set(expect) & tok.eos_ids:  # generation stops at the first end-of-sequence token
            expect = expect[: min(expect.index(t) for t in tok.eos_ids if t in expect) + 1]
        assert r.tokens == expect and r.ttft_s > 0
        assert r.text == tok.decode([t for t in expect if t not in tok.eos_ids])
        assert r.finish_reason == ("stop" if expect[-1] in tok.eos_ids else "length")
    assert rjax.generate(model, [], raw=True) == []


@pytest.mark.slow
def test_real_model_batched_equals_alone(smollm2):
    prompts = ["What is the capital of France?", "Write a haiku about rain.", "2+2=", "Name three colors."]
    batch = rjax.generate(smollm2, prompts, max_new_tokens=8, n_slots=3)
    for p, r in zip(prompts, batch):
        single = rjax.generate(smollm2, p, max_new_tokens=8)
        assert r.tokens == single.tokens, p


def test_decoding_a_bucket_of_slots_equals_decoding_all(tiny):
    """decode_dispatch over rows [R] of a paged cache (padded with n_slots) gives those slots the
    tokens, lengths and state a dispatch over every slot gives them, and leaves the others as
    they were: the engine runs only its running slots, in a batch of CONFIG.decode_bucket."""
    cfg, params = tiny
    assert CONFIG.decode_buckets == (1, 4, 8) and CONFIG.decode_bucket(2) == 4

    def started():
        eng = ServingEngine(cfg, params, CONFIG)
        for i, p in enumerate(_prompts(5, 5, cfg.vocab_size)):
            eng.submit(p, max_new_tokens=9, temperature=0.5 * (i % 2), seed=i)
        eng.step()  # prefill: five running slots, three free
        return eng

    full, sub = started(), started()
    running = sorted(full.scheduler.running)
    keep = running[1:4:2]  # two of them, padded to a bucket of 4
    rows = jnp.asarray(keep + [CONFIG.n_slots] * 2, jnp.int32)
    for s in set(running) - set(keep):
        full.runner.slots = slots.stop_slots(full.slots, jnp.asarray([s], jnp.int32))
    for e in (full, sub):
        for s in e.scheduler.running:
            e.pages.grow(s, e.scheduler.running[s].length + CONFIG.steps_per_dispatch)
        e.runner.sync_tables(list(e.scheduler.running), e.pages.tables)
    before = np.asarray(sub.cache.lengths)
    out_f, _, slots_f, cache_f = slots.decode_dispatch(cfg, params, full.cache, full.slots, 4)
    out_s, _, slots_s, cache_s = slots.decode_dispatch(cfg, params, sub.cache, sub.slots, 4, False, rows)
    out_f, out_s = np.asarray(out_f), np.asarray(out_s)
    others = [s for s in range(CONFIG.n_slots) if s not in keep]
    assert (out_s[keep] == out_f[keep]).all() and (out_s[keep] >= 0).all() and (out_s[others] == -1).all()
    lengths = np.asarray(cache_s.lengths)
    assert (lengths[keep] == np.asarray(cache_f.lengths)[keep]).all() and (lengths[others] == before[others]).all()
    for a, b in zip(jax.tree.leaves(slots_f.state), jax.tree.leaves(slots_s.state)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert (np.asarray(a)[keep] == np.asarray(b)[keep]).all()


def test_greedy_dispatch_is_the_general_one_without_sampling(tiny):
    """decode_dispatch(greedy=True), which the engine runs while every running request is greedy,
    gives the tokens, lengths and state (the random streams advanced alike) of the general
    program, which a batch with a sampled request runs; neither holds a conditional (XLA would
    evaluate it on the host once a step), and the greedy one leaves out sampling."""
    cfg, params = tiny

    def started(temperatures):
        eng = ServingEngine(cfg, params, CONFIG)
        for i, (p, t) in enumerate(zip(_prompts(7, 3, cfg.vocab_size), temperatures)):
            eng.submit(p, max_new_tokens=17, temperature=t, seed=i)
        eng.step()
        # The device may be a dispatch ahead of the host's lengths (`runs_ahead`): pages for both.
        for s in eng.scheduler.running:
            eng.pages.grow(s, eng.scheduler.running[s].length + 2 * CONFIG.steps_per_dispatch)
        eng.runner.sync_tables(list(eng.scheduler.running), eng.pages.tables)
        return eng

    runs = []
    for greedy in (False, True):
        eng = started([0.0] * 3)
        assert all_greedy(eng.scheduler.running.values())
        rows = jnp.asarray(sorted(eng.scheduler.running) + [CONFIG.n_slots], jnp.int32)
        runs.append(slots.decode_dispatch(cfg, params, eng.cache, eng.slots, 4, False, rows, greedy))
    (out_g, _, slots_g, cache_g), (out_s, _, slots_s, cache_s) = runs[1], runs[0]
    assert (np.asarray(out_g) == np.asarray(out_s)).all() and (np.asarray(out_g)[:3] >= 0).all()
    assert (np.asarray(cache_g.lengths) == np.asarray(cache_s.lengths)).all()
    for a, b in zip(jax.tree.leaves(slots_g.state), jax.tree.leaves(slots_s.state)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert (np.asarray(a) == np.asarray(b)).all()
    assert not all_greedy(started([0.0, 0.7, 0.0]).scheduler.running.values())
    eng = started([0.0] * 3)
    text = {g: slots.decode_dispatch.trace(cfg, params, eng.cache, eng.slots, 4, False, None, g).lower().as_text()
            for g in (False, True)}
    assert "stablehlo.case" not in text[False] and "@filtered_logits" in text[False]
    assert "stablehlo.case" not in text[True] and "@filtered_logits" not in text[True]


def test_unfiltered_dispatch_samples_the_same_tokens_without_the_filters(tiny):
    """Sampled slots without top-k / top-p draw the same tokens from decode_dispatch(filters=False),
    which the engine runs while no running request filters, as from the program that filters
    rows; the first holds no filters. A filtered request beside them changes none of
    their tokens (each slot's draw depends on its own key and settings alone)."""
    cfg, params = tiny

    def started(settings):
        eng = ServingEngine(cfg, params, CONFIG)
        for i, (p, (t, k, tp)) in enumerate(zip(_prompts(11, 4, cfg.vocab_size), settings)):
            eng.submit(p, max_new_tokens=17, temperature=t, top_k=k, top_p=tp, seed=i)
        eng.step()
        # The device may be a dispatch ahead of the host's lengths (`runs_ahead`): pages for both.
        for s in eng.scheduler.running:
            eng.pages.grow(s, eng.scheduler.running[s].length + 2 * CONFIG.steps_per_dispatch)
        eng.runner.sync_tables(list(eng.scheduler.running), eng.pages.tables)
        return eng

    plain = [(0.9, 0, 1.0), (1.3, 0, 1.0), (0.0, 0, 1.0)]
    outs = []
    for settings, filters in ((plain, False), (plain, True), (plain + [(0.9, 5, 0.8)], True)):
        eng = started(settings)
        assert sampling_variant(eng.scheduler.running.values()) == (False, len(settings) > len(plain), False)  # what the engine would run
        rows = jnp.asarray(sorted(eng.scheduler.running) + [CONFIG.n_slots] * (4 - len(eng.scheduler.running)), jnp.int32)
        out, _, _, _ = slots.decode_dispatch(cfg, params, eng.cache, eng.slots, 4, False, rows, False, filters)
        outs.append(np.asarray(out)[:3])
    assert (outs[0] >= 0).all() and (outs[0] == outs[1]).all() and (outs[0] == outs[2]).all()
    eng = started(plain)
    text = slots.decode_dispatch.trace(cfg, params, eng.cache, eng.slots, 4, False, None, False, False).lower().as_text()
    assert "@filtered_logits" not in text and "stablehlo.case" not in text
