"""The serving engine's host-only scheduler: the queue, the slots, the pages and the prefix index
(`rjax.runtime.pages.PageAllocator`), admission and chunking; it hands the runner (`rjax.runtime.runner`) a typed
step plan and turns what the device computed back into events. Nothing here touches the device,
so it runs, and is tested, with fake outcomes and no model.

A step, as `rjax.runtime.serving.ServingEngine.step` drives it:
1. `take_cancelled`: cancelled requests leave the queue, or are marked to be released;
2. `admit`: queued requests into free slots, first come first served, while the pool can promise
   each every page it may need (so a running sequence never runs out of pages and none is ever
   evicted); with the prefix cache a table starts with the cached pages of its prompt's prefix,
   and a request that would compute a page another admitted prompt is computing waits a step;
3. `chunks` + `prefill_plan` -> `PrefillPlan`: the next chunk of each prefilling request, packed
   within `max_prefill_tokens`; `prefilled` takes the first tokens of those whose prompt is in;
4. `decode_plan` (or `speculative_plan`) -> a plan over the running slots; `decoded` takes the
   tokens back;
5. `release`: the slots and pages of finished requests go back (full pages stay in the prefix
   cache, holding the prompt and the tokens generated).
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import time
from typing import Hashable

import numpy as np

from rjax.engine.steps import prompt_bucket
from rjax.runtime.pages import PageAllocator, page_hashes
from rjax.runtime.request import Request
from rjax.runtime.serving_events import Completion, StreamEvent, TokenLogprob, token_logprob
from rjax.runtime.serving_limits import ServingConfig


def fault(what: str, e: BaseException) -> str:
    return f"this request's {what} failed: {type(e).__name__}: {e}"


def all_greedy(seqs) -> bool:
    """Whether every one of `seqs` (the running sequences) decodes at temperature 0: a dispatch
    then runs the program without sampling (see `decode_dispatch`); slots not running are done,
    and what they would sample is dropped."""
    return all(r.request.temperature == 0 for r in seqs)


def sampling_variant(seqs) -> tuple[bool, bool, bool]:
    """decode_dispatch's (greedy, filters, adjust) for the running `seqs`: greedy alone, or
    sampling with the search that top-k / top-p need only where a sampled request uses them;
    logit adjustments only where a request has them (then in the one general program,
    whose greedy rows take the argmax: one more program to compile, not four)."""
    seqs = list(seqs)
    if any(r.request.adjust or r.request.constraint is not None for r in seqs):
        return False, True, True
    if all_greedy(seqs):
        return True, True, False
    return False, any(r.request.temperature > 0 and (r.request.top_k > 0 or r.request.top_p < 1) for r in seqs), False


def constraint_masks(running: dict) -> tuple[dict, list]:
    """Each constrained running slot's next mask; a constraint that raises fails alone.
    -> ({slot: mask}, faults)."""
    masks, faults = {}, []
    for s, r in running.items():
        if r.request.constraint is not None:
            try:
                masks[s] = r.request.constraint.mask()
            except Exception as e:
                faults.append((r, fault("constraint", e)))
    return masks, faults


@dataclasses.dataclass(eq=False)
class SeqState:
    """One submitted request and where it stands."""

    request_id: Hashable
    request: Request
    prompt: list[int]
    seed: int                 # 64 bits: the request's random stream
    submitted_s: float
    length_limit: int         # positions it may write at most: the prompt and every token but the last
    slot: int = -1
    length: int = 0           # positions the request holds in its slot
    tokens: list[int] = dataclasses.field(default_factory=list)
    token_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    first_token_s: float = 0.0
    prefilled: int = 0        # prompt positions in its slot so far (shared prefix pages included)
    hashes: list[bytes] | None = None   # content hashes of the prompt's full pages
    computing: list[bytes] = dataclasses.field(default_factory=list)  # those it computes, not yet indexed
    drafted: int = 0          # speculative decoding: draft tokens proposed for it, and accepted
    accepted: int = 0
    # A draft model: positions its cache holds in the slot, and whether the device keeps the
    # token at the next position as pending (fed in the next round); less than `length` otherwise
    # after plain decoding, caught up before the next speculative dispatch.
    draft_length: int = 0
    pending: bool = False

    def event(self, new: list[int], finished: bool, now: float, entries: list[TokenLogprob] | None = None,
              reason: str | None = None, error: str | None = None) -> StreamEvent:
        """Its event of this step: the new tokens, and when finished its Completion (reason None:
        "stop" if its last token is a stop id, else "length")."""
        if self.request.logprobs and entries is None:
            entries = []
        if not finished:
            return StreamEvent(self.request_id, new, False, logprobs=entries)
        if reason is None:
            reason = "stop" if self.tokens[-1] in self.request.stop_ids else "length"
        decode_s = now - self.first_token_s
        n = len(self.tokens)
        rate = (n - 1) / decode_s if decode_s > 0 and n > 1 else 0.0
        ttft = self.first_token_s - self.submitted_s if self.first_token_s else 0.0
        return StreamEvent(self.request_id, new, True,
                           Completion(self.request_id, self.prompt, list(self.tokens), reason, ttft, rate,
                                      list(self.token_logprobs) if self.request.logprobs else None, self.drafted,
                                      self.accepted, error),
                           logprobs=entries)


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """One prefill call: each sequence's next prompt chunk written into its slot; `last`: its
    prompt's last chunk, after which it samples its first token."""

    seqs: tuple[SeqState, ...]
    chunks: tuple[tuple[int, ...], ...]
    last: tuple[bool, ...]
    prompts: int              # the prompt count bucket
    tokens: int               # the chunk length bucket
    grown: tuple[int, ...]    # slots whose block tables changed


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """One decode dispatch over the running slots. rows: the slots in dispatch order (paged: only
    the running ones, padded to `batch`; contiguous: None, every slot)."""

    seqs: tuple[SeqState, ...]
    rows: tuple[int, ...] | None
    batch: int
    steps: int
    logprobs: bool
    greedy: bool
    filters: bool
    adjust: bool
    masks: dict               # each constrained slot's next token mask
    grown: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SpeculativePlan:
    """One speculative dispatch: every running slot drafts and verifies. histories: each row's
    tokens so far for prompt lookup (None for a free row)."""

    seqs: tuple[SeqState, ...]
    rows: tuple[int, ...]
    batch: int
    greedy: bool
    histories: tuple
    grown: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CatchUpPlan:
    """The draft model's cache catching up: each sequence's chunk of tokens it lacks."""

    seqs: tuple[SeqState, ...]
    chunks: tuple[tuple[int, ...], ...]
    prompts: int

    def done(self) -> None:
        """The chunks are in the draft cache."""
        for r, chunk in zip(self.seqs, self.chunks):
            r.draft_length, r.pending = r.draft_length + len(chunk), False


class Scheduler:
    """The host state of a serving engine. `draft_cache`: a draft model keeps a cache beside the
    target's, which holds only what both hold."""

    def __init__(self, config: ServingConfig, *, seed: int = 0, draft_cache: bool = False):
        self.config, self.draft_cache = config, draft_cache
        self.seeds = np.random.default_rng(seed)   # seeds of the requests that bring none
        self.queue: collections.deque[SeqState] = collections.deque()
        self.cancels: collections.deque = collections.deque()  # request ids; deque appends are thread-safe
        self.prefilling: list[SeqState] = []   # holding a slot, prompt not yet all in the cache (in order)
        self.running: dict[int, SeqState] = {}                # slot -> sequence (decoding)
        # Pages that admitted prompts are computing, by content hash: a prompt that would compute
        # one of them again waits a step and shares it instead.
        self.computing: collections.Counter[bytes] = collections.Counter()
        self.ids = itertools.count()
        self.live_ids: set = set()                           # ids of queued and running requests
        self.drafted = self.accepted = 0                     # speculative totals of finished requests
        self.new_pool()

    def new_pool(self) -> None:
        """Every slot free, and a fresh page pool."""
        c = self.config
        self.pages: PageAllocator | None = None
        if c.paged:
            self.pages = PageAllocator(c.pool_pages, c.n_slots, c.max_pages, c.page_size, prefix_cache=c.prefix_cache)
        self.free = list(range(c.n_slots))  # a heap: the lowest free slot is taken first

    # -- requests ---------------------------------------------------------------------------

    def submit(self, request: Request, request_id: Hashable = None) -> Hashable:
        if request_id is None:
            request_id = next(self.ids)
            while request_id in self.live_ids:
                request_id = next(self.ids)
        elif request_id in self.live_ids:
            raise ValueError(f"request id {request_id!r} is already queued or running")
        seed = int(self.seeds.integers(0, 2 ** 64, dtype=np.uint64)) if request.seed is None else request.seed
        self.live_ids.add(request_id)
        # The checks keep this within max_len - 1: one slot's table, which the pool can hold.
        limit = len(request.prompt) + request.max_new_tokens - 1
        self.queue.append(SeqState(request_id, request, list(request.prompt), seed, time.perf_counter(), limit))
        return request_id

    @property
    def held(self) -> list[SeqState]:
        """Sequences holding a slot: prefilling, then decoding."""
        return self.prefilling + list(self.running.values())

    @property
    def has_work(self) -> bool:
        return bool(self.queue or self.prefilling or self.running or self.cancels)

    def take_cancelled(self) -> tuple[list[SeqState], list[SeqState]]:
        """The cancelled (queued, holding a slot); the queued ones leave the queue, the others
        are for the caller to stop and release."""
        ids = set()
        while self.cancels:
            ids.add(self.cancels.popleft())
        ids &= self.live_ids
        if not ids:
            return [], []
        queued = [r for r in self.queue if r.request_id in ids]
        for r in queued:
            self.queue.remove(r)
            self.live_ids.discard(r.request_id)
        return queued, [r for r in self.held if r.request_id in ids]

    # -- prefill ----------------------------------------------------------------------------

    def admit(self) -> tuple[list[SeqState], list[SeqState]]:
        """Queued requests into free slots (see the module docstring). -> (those admitted,
        those whose table starts with shared pages: their slots' tables and lengths change)."""
        c, admitted, shared_rows = self.config, [], []
        while self.queue and self.free:
            req, shared = self.queue[0], []
            if self.pages is not None:
                if self.pages.prefix_cache and req.hashes is None:
                    req.hashes = page_hashes(req.prompt, c.page_size, len(req.prompt) // c.page_size)
                matchable = (req.hashes or [])[: (len(req.prompt) - 1) // c.page_size]
                shared = self.pages.match_hashes(matchable)
                if len(shared) < len(matchable) and self.computing[matchable[len(shared)]]:
                    break
                need = self.pages.pages_for(req.length_limit)
                if not self.pages.fits(need, shared):
                    break  # it waits for pages, and so do those behind it
            self.queue.popleft()
            req.slot = heapq.heappop(self.free)
            if self.pages is not None:
                self.pages.reserve(req.slot, need, shared)
                req.prefilled = len(shared) * c.page_size
                req.computing = (req.hashes or [])[len(shared):]
                self.computing.update(req.computing)
                if shared:
                    shared_rows.append(req)
            self.prefilling.append(req)
            admitted.append(req)
        if self.draft_cache:
            for r in shared_rows:
                r.draft_length = r.prefilled
        return admitted, shared_rows

    def chunks(self) -> list[tuple[SeqState, int]]:
        """(sequence, prompt tokens) for the next prefill call: the prefilling sequences in order,
        each with its next chunk, packed within `max_prefill_tokens`."""
        c, batch, longest = self.config, [], 0
        for r in self.prefilling[: c.max_prefill_prompts]:
            n = min(len(r.prompt) - r.prefilled, c.chunk_tokens)
            if batch and c.prefill_bucket(len(batch) + 1) * prompt_bucket(max(longest, n)) > c.max_prefill_tokens:
                break
            batch.append((r, n))
            longest = max(longest, n)
        return batch

    def prefill_plan(self, batch: list[tuple[SeqState, int]]) -> PrefillPlan:
        grown = () if self.pages is None else tuple(
            r.slot for r, n in batch if self.pages.grow(r.slot, r.prefilled + n))
        chunks = tuple(tuple(r.prompt[r.prefilled:r.prefilled + n]) for r, n in batch)
        last = tuple(r.prefilled + n == len(r.prompt) for r, n in batch)
        return PrefillPlan(tuple(r for r, _ in batch), chunks, last, self.config.prefill_bucket(len(batch)),
                           prompt_bucket(max(n for _, n in batch)), grown)

    def prefilled(self, plan: PrefillPlan, first: np.ndarray, done: np.ndarray, lp) -> tuple:
        """Take a prefill call's results: `first` [P] tokens, `done` [n_slots], `lp` (host
        TopLogprobs, or None when nobody asked). -> (events, finished, faults)."""
        for r, chunk in zip(plan.seqs, plan.chunks):
            r.prefilled += len(chunk)
            r.draft_length, r.pending = r.prefilled, False
            self.index(r, r.prompt[: r.prefilled])
        started = [(i, r) for i, (r, last) in enumerate(zip(plan.seqs, plan.last)) if last]
        if not started:
            return [], [], []
        self.prefilling = [r for r in self.prefilling if r.prefilled < len(r.prompt)]
        now = time.perf_counter()
        events, finished, faults = [], [], []
        for i, r in started:
            r.first_token_s = now
            r.length = len(r.prompt)
            self.running[r.slot] = r
            entries = [token_logprob(lp, i, None, int(first[i]))] if r.request.logprobs else None
            if r.request.constraint is not None:
                try:
                    r.request.constraint.advance(int(first[i]))
                except Exception as e:
                    faults.append((r, fault("constraint", e)))
                    continue
            events.append(self.add_tokens(r, [int(first[i])], entries, bool(done[r.slot]), now))
            if done[r.slot]:
                finished.append(r)
        return events, finished, faults

    # -- decode -----------------------------------------------------------------------------

    def speculates(self) -> bool:
        """Whether this step decodes speculatively: not while a running request asked for
        log-probabilities, logit adjustments or a constraint (both ways keep the same per-slot
        state, so requests move between them freely)."""
        return bool(self.config.speculative) and not any(
            r.request.logprobs or r.request.adjust or r.request.constraint for r in self.running.values())

    def _grow(self, positions: int) -> tuple[int, ...]:
        """Grow each running slot's pages to `positions` ahead (within its limit). -> the slots grown."""
        if self.pages is None:
            return ()
        return tuple(s for s, r in self.running.items()
                     if self.pages.grow(s, min(r.length + positions, r.length_limit)))

    def decode_plan(self, masks: dict, ahead: int = 0) -> DecodePlan:
        """The next decode dispatch over the running slots. `ahead`: positions a dispatch still in
        flight may add before this one runs (each slot's pages grow past them too)."""
        c = self.config
        grown = self._grow(c.steps_per_dispatch + ahead)
        greedy, filters, adjust = sampling_variant(self.running.values())
        return DecodePlan(tuple(self.running.values()), tuple(sorted(self.running)) if c.paged else None,
                          c.decode_bucket(len(self.running)), 1 if masks else c.steps_per_dispatch,
                          any(r.request.logprobs for r in self.running.values()), greedy, filters, adjust, masks, grown)

    def runs_ahead(self, plan: DecodePlan) -> bool:
        """Whether the dispatch after `plan`'s may be launched before `plan`'s results are read,
        so that the device runs it while the host reads and streams those: in a steady state only
        (nobody waiting for a slot, prefilling or cancelled; no running request that needs the
        host between dispatches for its mask or adjustments), and while some request can still
        decode past `plan`'s steps."""
        if (self.queue or self.prefilling or self.cancels or plan.masks or plan.adjust
                or plan.steps != self.config.steps_per_dispatch or self.speculates()):
            return False
        return any(r.length + plan.steps < r.length_limit for r in self.running.values())

    def decoded(self, plan: DecodePlan, out: np.ndarray, done: np.ndarray, lp) -> tuple:
        """Take a decode dispatch's tokens `out` [n_slots, steps] (-1: none), `done` [n_slots],
        `lp` (host TopLogprobs or None). -> (events, finished, faults). A request of the plan that
        ended while the dispatch ran (finished by the one before, cancelled, failed) is skipped:
        its slot was done on the device, or its tokens are no longer asked for."""
        now = time.perf_counter()
        events, finished, faults = [], [], []
        for r in plan.seqs:
            s = r.slot
            if self.running.get(s) is not r:
                continue
            steps = [i for i, t in enumerate(out[s]) if t >= 0]
            new = [int(out[s, i]) for i in steps]
            r.length += len(new)
            if r.request.constraint is not None:
                try:
                    for t in new:
                        r.request.constraint.advance(t)
                except Exception as e:
                    faults.append((r, fault("constraint", e)))
                    continue
            entries = [token_logprob(lp, s, i, int(out[s, i])) for i in steps] if r.request.logprobs else None
            events.append(self.add_tokens(r, new, entries, bool(done[s]), now))
            if done[s]:
                finished.append(r)
        return events, finished, faults

    def speculative_plan(self) -> SpeculativePlan:
        c = self.config
        grown = self._grow(c.steps_per_dispatch * (c.draft_tokens + 1))
        # As decoding: a paged engine runs only its running slots, padded to a decode bucket.
        order = sorted(self.running) if c.paged else list(range(c.n_slots))
        histories = tuple(self.running[s].prompt + self.running[s].tokens if s in self.running else None
                          for s in order)
        B = c.decode_bucket(len(order)) if c.paged else c.n_slots
        return SpeculativePlan(tuple(self.running.values()), tuple(order), B, all_greedy(self.running.values()),
                               histories, grown)

    def speculated(self, out: np.ndarray, drafted: np.ndarray, accepted: np.ndarray, done: np.ndarray,
                   draft_lengths: np.ndarray | None = None, pending: np.ndarray | None = None) -> tuple:
        """Take a speculative dispatch's results (with a draft model, also its cache's lengths
        and pending tokens, per slot). -> (events, finished)."""
        if draft_lengths is not None:
            for s, r in self.running.items():
                r.draft_length, r.pending = int(draft_lengths[s]), bool(pending[s] >= 0)
        now = time.perf_counter()
        events, finished = [], []
        for s, r in list(self.running.items()):
            new = [int(t) for t in out[s] if t >= 0]
            r.length += len(new)
            r.drafted += int(drafted[s])
            r.accepted += int(accepted[s])
            events.append(self.add_tokens(r, new, None, bool(done[s]), now))
            if done[s]:
                finished.append(r)
        return events, finished

    def catch_up_plan(self, tokens: int) -> CatchUpPlan | None:
        """The draft cache's next catch-up call, `tokens` per slot (None: every slot's draft
        cache holds its target length, or that less the pending token)."""
        behind = [r for r in self.running.values() if r.length - r.draft_length > r.pending]
        if not behind:
            return None
        return CatchUpPlan(tuple(behind), tuple(tuple((r.prompt + r.tokens)[r.draft_length: min(
            r.length, r.draft_length + tokens)]) for r in behind), self.config.decode_bucket(len(behind)))

    # -- events and release -----------------------------------------------------------------

    def add_tokens(self, r: SeqState, new: list[int], entries: list[TokenLogprob] | None, finished: bool,
                   now: float) -> StreamEvent:
        r.tokens.extend(new)
        if entries is not None:
            r.token_logprobs.extend(entries)
        return self.event(r, new, finished, now, entries)

    def event(self, r: SeqState, new: list[int], finished: bool, now: float, entries: list[TokenLogprob] | None = None,
              reason: str | None = None, error: str | None = None) -> StreamEvent:
        """`r`'s event of this step; a finished one adds its drafts to the speculative totals."""
        if finished:
            self.drafted += r.drafted
            self.accepted += r.accepted
        return r.event(new, finished, now, entries, reason, error)

    def release(self, finished: list[SeqState]) -> list[int]:
        """Free the slots and pages of finished (or cancelled) sequences; their full pages stay
        in the prefix cache. -> the slots, for the runner to reset."""
        slots = [r.slot for r in finished]
        for r in finished:
            self.live_ids.discard(r.request_id)
            self.running.pop(r.slot, None)
            if self.pages is not None:
                # The slot holds the K/V of every token but the last generated (never fed back),
                # or of the chunks prefilled so far; with a draft model, only the pages both
                # caches hold are offered.
                held = r.length or r.prefilled
                if self.draft_cache:
                    held = min(held, r.draft_length)
                self.index(r, (r.prompt + r.tokens)[:held])
                self._uncount(r, len(r.computing))   # a prompt cancelled before all were written
                self.pages.release(r.slot)
        gone = {id(r) for r in finished}
        self.prefilling = [r for r in self.prefilling if id(r) not in gone]
        for s in slots:
            heapq.heappush(self.free, s)
        return slots

    def drop_held(self) -> None:
        """Forget every sequence holding a slot (the device state they were in is lost), and
        start over with every slot free."""
        for r in self.held:
            self.live_ids.discard(r.request_id)
        self.prefilling, self.running = [], {}
        self.computing.clear()
        self.new_pool()

    def index(self, r: SeqState, tokens: list[int]) -> None:
        """Offer the full pages of `r`'s slot holding `tokens` to the prefix cache, and stop
        counting those it computed as in progress."""
        if self.pages is None or not self.pages.prefix_cache:
            return
        self.pages.register(r.slot, tokens)
        written = len(tokens) // self.config.page_size - (len(r.hashes) - len(r.computing))
        self._uncount(r, max(written, 0))

    def _uncount(self, r: SeqState, n: int) -> None:
        """The first n pages `r` was computing are written (or will never be)."""
        for h in r.computing[:n]:
            self.computing[h] -= 1
            if not self.computing[h]:
                del self.computing[h]
        r.computing = r.computing[n:]
