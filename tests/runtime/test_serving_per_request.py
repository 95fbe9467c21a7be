"""What the server needs of the serving engine, without HTTP: cancellation frees slots and pages
at once, seeded sampling does not depend on what runs beside it, log-probabilities equal
log_softmax of the logits and add one compiled program at most (tiny synthetic model on the
CPU)."""
from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

import rjax
from rjax.engine import slots
from rjax.math.sampling import MAX_TOP_LOGPROBS
from rjax.runtime import serving
from rjax.runtime.serving import ServingConfig, ServingEngine

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
