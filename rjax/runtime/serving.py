"""Continuous batching over cache slots: `ServingEngine`, the facade over a host-only scheduler
(`rjax.runtime.scheduler`: queue, slots, pages, prefix index; it makes each step's plan) and a runner
(`rjax.runtime.runner`: the cache and slot state on the device; it runs each plan) of the pure jitted
slot functions in `rjax.engine.slots`.

`ServingEngine` keeps one cache of `n_slots` rows (paged or contiguous) and, per slot, the decode
state, sampling parameters and stop ids as device arrays (`rjax.engine.slots.SlotBatch`). Each `step()`:

1. admits queued requests into free slots (first come, first served) and prefills all of them
   in one multi-prompt call (`prefill_into_slots`), each prompt written straight into its slot;
2. runs one decode dispatch (`decode_dispatch`: `steps_per_dispatch` decode steps, sampling and
   stop conditions in one XLA program) over every slot (free and finished slots are masked off);
3. streams the new tokens of every request (`rjax.runtime.serving_events`), and frees the slots of
   finished ones: their pages go back to the free list and the slot's length is reset by a pure
   function.

With `ServingConfig.speculative` the decode dispatch drafts and verifies instead
(`rjax.engine.speculative.speculative_dispatch`): by prompt lookup, or with a draft model (`draft=`),
whose own cache (paged: its own pool under the target's block tables) is written with every
prefill chunk and rolled back with the target's.

A request is one typed value (`rjax.runtime.request.Request`), checked once when it is built
(`limits.request(...)`, or `submit`'s keywords); `cancel(request_id)` may be called from any
thread; the cancellation is applied at the start of the next `step`, which frees the request's
slot and pages. Prompt counts and lengths are padded to buckets, which bounds the number of
compiled programs (`rjax.runtime.serving_programs`).

Limits (`rjax.runtime.serving_limits`, `rjax.runtime.request`), and what happens beyond them:
- a request that could never run as asked (a bad prompt, a prompt plus max_new_tokens beyond
  `max_len`, bad sampling settings or stop ids) is refused when it is built, and nothing changes;
- more requests than free slots, or than free pages, wait in the queue (admission reserves the
  pages a request may need at most, so a running sequence never runs out of pages and no
  sequence is ever evicted);
- a cancelled request ends with finish reason "cancelled".

Faults: host-side work of one request that raises (its sampling set-up, its constraint's mask or
advance) ends that request alone with finish reason "error" (`Completion.error` says what
failed); the others go on. A device program that fails (`run_program` raises: out of memory,
say) fails the requests in it; if the failed call took the cache or slot state with it, every
request holding a slot fails and the engine goes on over a fresh cache. Queued requests wait on.
"""
from __future__ import annotations

import logging
import time
from typing import Hashable, Iterator, Sequence

from rjax.engine.memory import kv_bytes_per_position, plan_memory
from rjax.engine.speculative import check_draft_model
from rjax.math.config import ModelConfig
from rjax.math.model import Params
from rjax.runtime.pages import PrefixCacheStats
from rjax.runtime.request import Limits, Request, check_stop_ids
from rjax.runtime.runner import DispatchError, InFlight, Runner, run_program  # noqa: F401 (part of this module's API)
from rjax.runtime.scheduler import Scheduler, SeqState, constraint_masks
from rjax.runtime.serving_events import Completion, StreamEvent, TokenLogprob  # noqa: F401 (part of this module's API)
from rjax.runtime.serving_limits import ServingConfig
from rjax.runtime.serving_programs import FIRST_PROMPT_TOKENS

log = logging.getLogger("rjax.runtime.serving")


def check_memory(cfg: ModelConfig, params: Params, config: ServingConfig, draft_cfg: ModelConfig | None = None, *,
                 available_bytes: int | None = None, budget_bytes: int | None = None,
                 reserve_bytes: int | None = None):
    """The memory plan of an engine of `config` (`rjax.engine.memory.plan_memory`), before anything is
    allocated: MemoryFitError where its cache and workspace do not fit."""
    return plan_memory(cfg, max_len=config.max_len, page_size=config.page_size, n_slots=config.n_slots,
                       n_pages=config.pool_pages if config.paged else None, prefill_tokens=config.max_prefill_tokens,
                       prefill_prompts=config.max_prefill_prompts, dtype=config.kv_dtype, reserve_bytes=reserve_bytes,
                       available=available_bytes, budget_bytes=budget_bytes,
                       tp=1 if params.tp is None else params.tp.size, draft_cfg=draft_cfg)


def check_draft(cfg: ModelConfig, config: ServingConfig, draft) -> ModelConfig | None:
    """-> the draft model's config, or None without one; ValueError for a draft that config
    does not ask for or cannot use."""
    if config.speculative != "model":
        if draft is not None:
            raise ValueError(f"draft: a draft model is given but ServingConfig.speculative is "
                             f"{config.speculative!r}; a draft model drafts with speculative='model'")
        return None
    if draft is None:
        raise ValueError("ServingConfig.speculative='model' needs the draft model: "
                         "ServingEngine(..., draft=(config, params))")
    if not (isinstance(draft, tuple) and len(draft) == 2 and isinstance(draft[0], ModelConfig)):
        raise TypeError(f"draft must be a (ModelConfig, Params) pair, got {type(draft).__name__}")
    dcfg = draft[0]
    check_draft_model(cfg, None, dcfg, None, "given as draft")
    if config.max_len > dcfg.context_length:
        raise ValueError(f"draft: the draft model's context of {dcfg.context_length} tokens is shorter than "
                         f"ServingConfig.max_len {config.max_len}")
    return dcfg


class ServingEngine:
    """Continuous batching over one model: `submit` requests, then iterate `run()` (or call
    `step()`) for (request_id, new tokens, finished) events. Not thread-safe beyond `submit`,
    `cancel` and `limits`, which may be used from another thread while the serving thread steps."""

    def __init__(self, cfg: ModelConfig, params: Params, config: ServingConfig = ServingConfig(), *,
                 stop_ids: Sequence[int] = (), seed: int = 0, available_bytes: int | None = None,
                 budget_bytes: int | None = None, reserve_bytes: int | None = None,
                 draft: tuple[ModelConfig, Params] | None = None):
        """stop_ids: the default stop set of every request (usually the tokenizer's end-of-sequence
        ids). available_bytes / budget_bytes / reserve_bytes: see `rjax.engine.memory.plan_memory`; the
        cache is checked against the free memory before it is allocated (MemoryFitError).
        draft: (config, params) of the draft model of ServingConfig(speculative="model"), with the
        target's vocabulary; it keeps a cache of its own, of the target's kind and size."""
        if config.max_len > cfg.context_length:
            raise ValueError(f"ServingConfig.max_len {config.max_len} exceeds the model's context length "
                             f"{cfg.context_length}")
        dcfg = check_draft(cfg, config, draft)
        self.cfg, self.params, self.config = cfg, params, config
        self.limits = Limits(cfg.vocab_size, config.max_len, config.max_stop_ids,
                             check_stop_ids(stop_ids, cfg.vocab_size, config.max_stop_ids), cfg.d_model)
        check_memory(cfg, params, config, dcfg, available_bytes=available_bytes, budget_bytes=budget_bytes,
                     reserve_bytes=reserve_bytes)
        self.runner = Runner(cfg, params, config, draft if dcfg is not None else None)
        self._ahead: InFlight | None = None       # a decode dispatch launched ahead, not yet read
        self.scheduler = Scheduler(config, seed=seed, draft_cache=dcfg is not None)
        self._outbox: list[StreamEvent] = []      # events of requests that failed mid-step, for step to return
        self.failed_steps = 0                     # device programs of steps that failed
        self.last_failure: str | None = None
        per_position = kv_bytes_per_position(cfg, config.kv_dtype) + \
            (kv_bytes_per_position(dcfg, config.kv_dtype) if dcfg else 0)   # the draft model's cache too
        self.kv_bytes = (config.pool_pages * config.page_size if config.paged else config.n_slots * config.max_len) \
            * per_position

    # The runner's device state and the scheduler's pages, for inspection.
    cache = property(lambda self: self.runner.cache)
    slots = property(lambda self: self.runner.slots)
    draft_cache = property(lambda self: self.runner.draft_cache)
    pending = property(lambda self: self.runner.pending)
    drafter = property(lambda self: self.runner.drafter)
    draft_params = property(lambda self: self.runner.draft_params)
    pages = property(lambda self: self.scheduler.pages)
    default_stop_ids = property(lambda self: self.limits.default_stop_ids)

    # -- compiling ahead --------------------------------------------------------------------

    def prefill_shapes(self, prompt_lengths: Sequence[int] | None = None) -> list[tuple[int, int]]:
        """The (prompt count bucket, chunk length bucket) pairs a prefill call can take
        (`rjax.runtime.serving_programs.ServingPrograms.prefill_shapes`)."""
        return self.runner.programs.prefill_shapes(prompt_lengths)

    def precompile(self, prompt_lengths: Sequence[int] | None = None, workers: int | None = None,
                   progress: bool = False, logprobs: bool = False):
        """Compile the programs `step` calls (the decode dispatch, also its log-probability
        variant with `logprobs`; the speculative dispatch; every prefill shape of
        `prefill_shapes(prompt_lengths)`; a draft model's prefill, and with `logprobs` its
        catch-up) concurrently, before any request: a server pays its compile time at start-up
        rather than on its first requests. -> rjax.engine.precompile.CompileReport."""
        return self.runner.programs.precompile(prompt_lengths, workers, progress, logprobs)

    def precompile_first(self, logprobs: bool = False, workers: int | None = None, background_workers: int = 1,
                         first_tokens: int = FIRST_PROMPT_TOKENS):
        """Compile now what a first request of ordinary size needs (one prompt of up to
        `first_tokens` tokens, greedy or sampled without top-k / top-p, decoding alone), and the
        rest of `precompile`'s programs in `background_workers` threads while the engine serves
        (`compiling` names those not yet built). Until a program is built, a call that needs it
        runs in a larger one that is built (a prompt padded further, a batch padded to more
        rows, a sampled program for greedy rows), or waits for it; the log says which.
        -> the CompileReport of the first programs."""
        return self.runner.programs.precompile_first(logprobs, workers, background_workers, first_tokens)

    @property
    def compiling(self) -> list[str]:
        """Programs `precompile_first` left to build in the background, not yet built."""
        return self.runner.programs.compiling

    def stop_compiling(self) -> None:
        """Start no more of the background's programs (an engine being replaced or shut down)."""
        self.runner.programs.stop_compiling()

    # -- requests ---------------------------------------------------------------------------

    def check_request(self, prompt: Sequence[int], **settings) -> tuple[list[int], tuple[int, ...]]:
        """Raise ValueError (or TypeError) for a request `submit` would refuse (`limits.request`);
        any thread may call it. -> (the prompt, the request's stop ids), as ints."""
        request = self.limits.request(prompt, **settings)
        return list(request.prompt), request.stop_ids

    def submit(self, prompt: Sequence[int] | Request, *, request_id: Hashable = None, **settings) -> Hashable:
        """Queue a request: a `Request` (built by `limits.request`), or a tokenized prompt and
        the keywords of `rjax.runtime.request.Limits.request`. -> its request id (`request_id`, or a new
        integer). Raises ValueError (or TypeError) for a request that could never run, or whose
        id is already queued or running, and then changes nothing.

        max_new_tokens, temperature, top_k, top_p; stop_ids (None: the engine's default set);
        seed: the request's random stream (any integer, taken modulo 2**64; None: one drawn from
        the engine's seed); sample_index: folded into that stream, so several samples of one
        seed differ. logprobs: its events carry TokenLogprob entries, one per token.
        presence_penalty, frequency_penalty, repetition_penalty, min_p, logit_bias ({token id:
        bias}), as the OpenAI API and vLLM define them (`rjax.math.sampling.adjust_logits`).
        constraint: a fresh `rjax.runtime.grammar.Constraint` (or anything with its mask() and
        advance(token)): every token the request generates is one its mask allows. While a
        constrained request runs, a decode dispatch is one step, for the host to compute the
        next mask."""
        if isinstance(prompt, Request):
            if settings:
                raise TypeError(f"submit: a Request carries its settings; got {', '.join(sorted(settings))} too")
            request = prompt
        else:
            request = self.limits.request(prompt, **settings)
        return self.scheduler.submit(request, request_id)

    def cancel(self, request_id: Hashable) -> None:
        """Stop a queued or running request: at the start of the next `step` it leaves the queue,
        or its slot and pages are freed, and the step reports it finished with reason
        "cancelled". Safe from any thread; an unknown or already finished id is ignored."""
        self.scheduler.cancels.append(request_id)

    n_queued = property(lambda self: len(self.scheduler.queue))
    n_running = property(lambda self: len(self.scheduler.running) + len(self.scheduler.prefilling),
                         doc="Requests holding a slot: decoding, or with their prompt still being prefilled.")
    n_free_slots = property(lambda self: len(self.scheduler.free))
    has_work = property(lambda self: self.scheduler.has_work or self._ahead is not None)
    # Whether a decode dispatch launched ahead is still to be read: the device cache and slot
    # state are then up to one dispatch ahead of the scheduler's lengths.
    runs_ahead = property(lambda self: self._ahead is not None)

    @property
    def pages_in_use(self) -> int | None:
        """KV pages that sequences hold now (None for a contiguous cache)."""
        return None if self.pages is None else self.pages.n_held

    @property
    def prefix_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counts (lookups, hits, pages reused, tokens saved, evictions) and
        pages cached; None without a prefix cache."""
        if self.pages is None or not self.pages.prefix_cache:
            return None
        return self.pages.stats

    @property
    def speculative_stats(self) -> dict:
        """Draft tokens proposed and accepted, over the requests finished so far (speculative decoding)."""
        return dict(drafted=self.scheduler.drafted, accepted=self.scheduler.accepted)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> Iterator[StreamEvent]:
        """Step until every submitted request (including ones submitted meanwhile) has finished."""
        while self.has_work:
            yield from self.step()

    def step(self) -> list[StreamEvent]:
        """Apply cancellations, admit and prefill what fits, then one decode dispatch.
        -> the events it produced."""
        events = self._apply_cancels()
        try:
            events += self._prefill()
        except DispatchError as e:
            events += self._dispatch_failed(e)
        if self.scheduler.running or self._ahead is not None:
            try:
                events += self._decode()
            except DispatchError as e:
                events += self._dispatch_failed(e)
        events, self._outbox = events + self._outbox, []
        return events

    def _apply_cancels(self) -> list[StreamEvent]:
        queued, held = self.scheduler.take_cancelled()
        self._stop(held)
        now = time.perf_counter()
        events = [self.scheduler.event(r, [], True, now, reason="cancelled") for r in queued + held]
        self._release(held)
        return events

    def _prefill(self) -> list[StreamEvent]:
        """Admit what fits, then one prefill call: the next chunk of each prefilling request.
        A request whose last chunk this is samples its first token and starts decoding."""
        s, r = self.scheduler, self.runner
        admitted, shared = s.admit()
        for seq in admitted:
            if seq.request.penalized:  # before any prefill: its first token is penalized too
                r.start_history(seq.slot, seq.prompt)
        if shared:
            r.sync_tables([q.slot for q in shared], s.pages.tables)
            r.set_lengths([q.slot for q in shared], [q.prefilled for q in shared])
        batch = s.chunks()
        setup, faults = r.prefill_setup(batch)
        if faults:
            self._fail(faults)
            batch = [(q, n) for q, n in batch if id(q) in setup]
        if not batch:
            return []
        plan = s.prefill_plan(batch)
        if plan.grown:
            r.sync_tables(plan.grown, s.pages.tables)
        first, done, lp = r.prefill(plan, setup)
        events, finished, faults = s.prefilled(plan, first, done, lp)
        self._release(finished)
        self._fail(faults)
        return events

    def _decode(self) -> list[StreamEvent]:
        """One decode dispatch's tokens: of the dispatch the last step launched ahead, or of one
        launched now. In a steady state (`Scheduler.runs_ahead`) the next dispatch is launched
        before these tokens are read back, so that the device decodes on while the host reads,
        streams and plans (a request that ends meanwhile is done on the device: the dispatch
        ahead writes nothing for it)."""
        s, r = self.scheduler, self.runner
        flight, self._ahead = self._ahead, None
        if flight is None:
            if s.speculates():
                return self._decode_speculative()
            masks, faults = constraint_masks(s.running)
            self._fail(faults)
            if not s.running:
                return []
            plan = s.decode_plan(masks)
            if plan.grown:
                r.sync_tables(plan.grown, s.pages.tables)
            flight = r.launch_decode(plan, wait=False)
            if s.runs_ahead(flight.plan):
                flight = r.keep(flight)
        if s.runs_ahead(flight.plan):
            plan = s.decode_plan({}, ahead=flight.plan.steps)
            if plan.grown:
                r.sync_tables(plan.grown, s.pages.tables)
            # Its done flags kept apart: the next step's prefill or stop takes the slot state.
            self._ahead = r.keep(r.launch_decode(plan, wait=False))
        events, finished, faults = s.decoded(flight.plan, *r.read(flight))
        self._release(finished)
        self._fail(faults)
        return events

    def _decode_speculative(self) -> list[StreamEvent]:
        """`_decode` by speculative rounds: every running slot drafts from its own tokens, or all
        slots together with the draft model over its own cache; one forward pass per round
        verifies all slots' drafts, and each slot keeps what it accepted. The draft cache, left
        behind by plain decoding meanwhile, catches up first."""
        s, r = self.scheduler, self.runner
        plan = s.speculative_plan()
        if plan.grown:
            r.sync_tables(plan.grown, s.pages.tables)
        if r.draft_model:
            while (catch_up := s.catch_up_plan(r.catch_up_tokens)) is not None:
                r.catch_up(catch_up)
                catch_up.done()
        events, finished = s.speculated(*r.speculative(plan))
        self._release(finished)
        return events

    def _release(self, finished: list[SeqState]) -> None:
        """Free the slots and pages of finished (or cancelled) requests."""
        if finished:
            self.runner.free(self.scheduler.release(finished))

    def _stop(self, held: list[SeqState]) -> None:
        """Mark the decoding slots of `held` done on the device, so no dispatch writes them."""
        if any(q.slot in self.scheduler.running for q in held):
            self.runner.stop([q.slot for q in held])

    def _fail(self, faults: list[tuple[SeqState, str]]) -> None:
        """End requests holding a slot whose own host-side work raised, each alone with finish
        reason "error" (its events go out with the step's), freeing their slots and pages."""
        if not faults:
            return
        now = time.perf_counter()
        for q, what in faults:
            log.error("request %r failed: %s", q.request_id, what)
        held = [q for q, _ in faults]
        self._stop(held)
        self._outbox += [self.scheduler.event(q, [], True, now, reason="error", error=what) for q, what in faults]
        self._release(held)

    def _dispatch_failed(self, e: DispatchError) -> list[StreamEvent]:
        """The requests of a failed device program fail, their slots and pages freed. If the
        failed call took the cache or slot state with it (donated to it, or results it never
        computed), so does every request holding a slot, and the engine starts over a fresh
        cache; queued requests wait on either way."""
        s = self.scheduler
        self.failed_steps += 1
        self.last_failure = str(e)
        lost = not self.runner.state_ok()
        failed = {id(q): q for q in e.requests if q.request_id in s.live_ids}
        if lost:
            failed |= {id(q): q for q in s.held}
        failed = list(failed.values())
        log.error("%s; %s; failed request(s): %s", e, "the cache and slot state were lost with it and are allocated "
                  "afresh" if lost else "the cache is intact", ", ".join(repr(q.request_id) for q in failed) or "none")
        now = time.perf_counter()
        in_it = {id(q) for q in e.requests}
        events = [s.event(q, [], True, now, reason="error", error=f"{e} (this request was in it)"
                          if id(q) in in_it else f"{e}, and with it the KV cache of this request")
                  for q in failed]
        if lost:
            for q in failed:
                s.live_ids.discard(q.request_id)
            s.drop_held()
            self._ahead = None  # a dispatch launched ahead ran on the lost state
            self.runner.allocate()
        else:
            self._stop(failed)
            self._release(failed)
        return events


def serve(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], config: ServingConfig = ServingConfig(),
          *, stop_ids: Sequence[int] = (), seed: int = 0, **request) -> list[Completion]:
    """Run every prompt through one ServingEngine (same request settings for all) -> completions in
    prompt order."""
    eng = ServingEngine(cfg, params, config, stop_ids=stop_ids, seed=seed)
    ids = [eng.submit(p, **request) for p in prompts]
    done = {e.request_id: e.completion for e in eng.run() if e.finished}
    return [done[i] for i in ids]
