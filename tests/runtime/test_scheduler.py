"""The serving scheduler on the host alone: requests in, step plans out, fake device outcomes
back (no model, no device program): admission order, page accounting, chunking, prefix-cache
hits, cancellation and the events of finished requests."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import rjax
from rjax.runtime.request import Limits
from rjax.runtime.scheduler import Scheduler, all_greedy, sampling_variant
from rjax.runtime.serving_limits import ServingConfig

STOP = 99
LIMITS = Limits(vocab_size=100, max_len=64, max_stop_ids=8, default_stop_ids=(STOP,), embedding_size=8)


def _config(**kw):
    return ServingConfig(**{**dict(n_slots=2, max_len=64, page_size=16, steps_per_dispatch=4,
                                   prefill_buckets=(1, 2), max_prefill_tokens=64), **kw})


def _prefill(s: Scheduler, first_tokens=None):
    """One prefill step with fake first tokens (1 each unless given). -> (plan, events)."""
    s.admit()
    plan = s.prefill_plan(s.chunks())
    first = np.asarray(first_tokens or [1] * plan.prompts, np.int32)
    events, finished, faults = s.prefilled(plan, first, np.zeros(s.config.n_slots, bool), None)
    assert not faults
    s.release(finished)
    return plan, events


def _decode(s: Scheduler, tokens: dict[int, list[int]], done=()):
    """One decode step whose device output is `tokens` per slot. -> events."""
    plan = s.decode_plan({})
    out = np.full((s.config.n_slots, plan.steps), -1, np.int32)
    for slot, ts in tokens.items():
        out[slot, : len(ts)] = ts
    flags = np.zeros(s.config.n_slots, bool)
    flags[list(done)] = True
    events, finished, faults = s.decoded(plan, out, flags, None)
    s.release(finished)
    return events


def test_admission_is_first_come_first_served_into_the_lowest_free_slot():
    s = Scheduler(_config())
    ids = [s.submit(LIMITS.request([1, 2, 3], max_new_tokens=4)) for _ in range(3)]
    admitted, shared = s.admit()
    assert [r.request_id for r in admitted] == ids[:2] and [r.slot for r in admitted] == [0, 1] and not shared
    assert [r.request_id for r in s.queue] == [ids[2]] and s.free == []
    # a request id given twice is refused, and nothing changes
    with pytest.raises(ValueError, match="already queued or running"):
        s.submit(LIMITS.request([1], max_new_tokens=4), ids[2])
    assert len(s.queue) == 1
    s.release([admitted[1]])
    assert s.free == [1] and not s.pages.owned[1]
    (third,), _ = s.admit()
    assert third.request_id == ids[2] and third.slot == 1


def test_admission_reserves_every_page_a_request_may_need_and_waits_for_them():
    # 5 pages: one request of 20 + 30 tokens may need 4 (49 positions), so the next waits
    s = Scheduler(_config(n_pages=5, prefix_cache=False))
    a = s.submit(LIMITS.request(list(range(1, 21)), max_new_tokens=30))
    b = s.submit(LIMITS.request([1, 2], max_new_tokens=30))
    admitted, _ = s.admit()
    assert [r.request_id for r in admitted] == [a] and s.free == [1]
    assert s.pages.unreserved == 1 and s.pages.pages_for(admitted[0].length_limit) == 4
    assert [r.request_id for r in s.queue] == [b]
    plan, events = _prefill(s)
    assert plan.grown == (0,) and s.pages.owned[0] == 2        # the prompt's 20 positions: 2 pages
    assert events[0].tokens == [1] and not events[0].finished
    _decode(s, {0: [5, 6, 7, 8]})
    assert s.running[0].length == 24 and s.running[0].tokens == [1, 5, 6, 7, 8]
    _decode(s, {0: [STOP]}, done=[0])
    assert not s.running and s.pages.n_held == 0 and s.pages.unreserved == 5
    (second,), _ = s.admit()
    assert second.request_id == b


def test_a_long_prompt_is_prefilled_in_chunks_packed_within_the_token_budget():
    s = Scheduler(_config(max_prefill_tokens=32, max_len=128))   # chunks of 32 tokens
    limits = Limits(100, 128, 8, (STOP,), 8)
    long_id = s.submit(limits.request(list(range(1, 71)), max_new_tokens=8))
    short_id = s.submit(limits.request([7] * 5, max_new_tokens=8))
    s.admit()
    plans = []
    while s.prefilling:
        plan = s.prefill_plan(s.chunks())
        plans.append(plan)
        s.prefilled(plan, np.ones(plan.prompts, np.int32), np.zeros(2, bool), None)
    # a call packs 2 prompts of a 16-token bucket or 1 of 32: the long prompt goes alone, its last
    # chunk (6 tokens) beside the short prompt
    assert [[len(c) for c in p.chunks] for p in plans] == [[32], [32], [6, 5]]
    assert [p.last for p in plans] == [(False,), (False,), (True, True)]
    assert [(p.prompts, p.tokens) for p in plans] == [(1, 32), (1, 32), (2, 16)]
    assert plans[0].chunks[0] + plans[1].chunks[0] + plans[2].chunks[0] == tuple(range(1, 71))
    assert {r.request_id: r.length for r in s.running.values()} == {long_id: 70, short_id: 5}


def test_a_prompt_shares_the_cached_pages_of_its_prefix_once_they_are_written():
    s = Scheduler(_config())
    prefix = list(range(1, 33))                                 # two full pages
    a = s.submit(LIMITS.request(prefix + [40, 41], max_new_tokens=4))
    b = s.submit(LIMITS.request(prefix + [50], max_new_tokens=4))
    admitted, _ = s.admit()
    # b would compute the pages a is computing: it waits a step
    assert [r.request_id for r in admitted] == [a] and len(s.queue) == 1 and sum(s.computing.values()) == 2
    _prefill(s)
    assert not s.computing
    admitted, shared = s.admit()
    assert [r.request_id for r in admitted] == [b] == [r.request_id for r in shared]
    assert shared[0].prefilled == 32 and s.pages.stats.hits == 1 and s.pages.stats.pages_reused == 2
    plan = s.prefill_plan(s.chunks())
    assert plan.chunks == ((50,),)                             # only what the cache does not hold
    np.testing.assert_array_equal(s.pages.tables[1, :2], s.pages.tables[0, :2])


def test_cancel_ends_queued_and_running_requests_and_frees_their_slots():
    s = Scheduler(_config())
    ids = [s.submit(LIMITS.request([1, 2, 3], max_new_tokens=8)) for _ in range(3)]
    _prefill(s)
    s.cancels.extend([ids[1], ids[2], "unknown"])
    queued, held = s.take_cancelled()
    assert [r.request_id for r in queued] == [ids[2]] and [r.request_id for r in held] == [ids[1]]
    events = [s.event(r, [], True, 0.0, reason="cancelled") for r in queued + held]
    assert [e.completion.finish_reason for e in events] == ["cancelled"] * 2
    assert s.release(held) == [1]
    assert list(s.running) == [0] and s.free == [1] and not s.queue and s.live_ids == {ids[0]}
    assert s.pages.n_held == 1


def test_finished_requests_end_by_stop_id_or_length_with_their_tokens():
    s = Scheduler(_config())
    a = s.submit(LIMITS.request([1, 2], max_new_tokens=3))
    b = s.submit(LIMITS.request([3, 4], max_new_tokens=8, temperature=0.5, top_k=5))
    _prefill(s, [10, 20])
    assert not all_greedy(s.running.values()) and sampling_variant(s.running.values()) == (False, True, False)
    events = _decode(s, {0: [11, 12], 1: [21, STOP]}, done=[0, 1])
    done = {e.request_id: e.completion for e in events}
    assert done[a].tokens == [10, 11, 12] and done[a].finish_reason == "length"
    assert done[b].tokens == [20, 21, STOP] and done[b].finish_reason == "stop"
    assert not s.has_work and s.free == [0, 1] and s.pages.n_held == 0


def test_a_dispatch_runs_ahead_only_in_a_steady_state_and_its_plan_reaches_two_dispatches():
    """The next dispatch is launched before this one is read only while nothing waits and no
    running request needs the host between dispatches, and while some request has tokens left
    past this dispatch; its pages cover both dispatches. A request that ends while it runs (by
    the dispatch before) gets nothing from it."""
    s = Scheduler(_config(page_size=4))
    a = s.submit(LIMITS.request([1, 2], max_new_tokens=3))
    b = s.submit(LIMITS.request([3, 4], max_new_tokens=20))
    late = s.submit(LIMITS.request([5], max_new_tokens=4))
    _prefill(s, [10, 20])
    plan = s.decode_plan({})
    assert not s.runs_ahead(plan)  # `late` waits for a slot
    s.cancels.append(late)
    assert s.take_cancelled()[0][0].request_id == late
    assert s.runs_ahead(plan)
    ahead = s.decode_plan({}, ahead=plan.steps)
    assert s.pages.tables[1, :3].min() >= 0  # b: 2 positions + 2 dispatches of 4 steps = 3 pages of 4
    # a finishes in the first dispatch; the dispatch ahead wrote nothing for it
    out = np.full((2, 4), -1, np.int32)
    out[0, :2], out[1] = [11, 12], [21, 22, 23, 24]
    events, finished, _ = s.decoded(plan, out, np.array([True, False]), None)
    assert [e.request_id for e in events] == [a, b] and finished[0].request_id == a
    s.release(finished)
    out2 = np.full((2, 4), -1, np.int32)
    out2[1] = [25, 26, 27, 28]
    events, finished, _ = s.decoded(ahead, out2, np.array([True, False]), None)
    assert [e.request_id for e in events] == [b] and events[0].tokens == [25, 26, 27, 28] and not finished
    # b has 20 - 9 = 11 tokens left: more dispatches ahead; a constrained or penalized request stops that
    assert s.runs_ahead(s.decode_plan({}))
    b_state = s.running[1]
    assert not s.runs_ahead(s.decode_plan({1: np.zeros(4, np.int32)}))
    b_state.length = b_state.length_limit - 4  # its last dispatch: nothing left to run ahead for
    assert not s.runs_ahead(s.decode_plan({}))


def test_the_scheduler_touches_no_device():
    """The scheduler, the page allocator and the request import no jax themselves (their plans and
    outcomes are host data: tuples and NumPy arrays)."""
    root = Path(rjax.__file__).parent / "runtime"
    for name in ("scheduler.py", "pages.py", "request.py"):
        tree = ast.parse((root / name).read_text(encoding="utf-8"))
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "jax" not in imported, name
