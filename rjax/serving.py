"""Continuous batching over cache slots: the host-side scheduler (`ServingEngine`) of the pure
jitted slot functions in `rjax.slots`.

`ServingEngine` keeps one cache of `n_slots` rows (paged or contiguous) and, per slot, the decode
state, sampling parameters and stop ids as device arrays (`rjax.slots.SlotBatch`). Each `step()`:

1. admits queued requests into free slots (first come, first served) and prefills all of them
   in one multi-prompt call (`prefill_into_slots`), each prompt written straight into its slot;
2. runs one decode dispatch (`decode_dispatch`: `steps_per_dispatch` decode steps, sampling and
   stop conditions in one XLA program) over every slot (free and finished slots are masked off);
3. streams the new tokens of every request (`rjax.serving_events`), and frees the slots of
   finished ones: their pages go back to the free list and the slot's length is reset by a pure
   function.

Log-probabilities cross to the host only for the requests that asked for them, and a decode
dispatch computes them only while such a request runs. `cancel(request_id)` may be called from
any thread; the cancellation is applied at the start of the next `step`, which frees the
request's slot and pages. Prompt counts and lengths are padded to buckets, which bounds the
number of compiled programs.

Limits (`rjax.serving_limits`), and what happens beyond them:
- a request that could never run as asked (a bad prompt, a prompt plus max_new_tokens beyond
  `max_len`, bad sampling settings or stop ids) is refused by `submit`, and nothing changes;
- more requests than free slots, or than free pages, wait in the queue (admission reserves the
  pages a request may need at most, so a running sequence never runs out of pages and no
  sequence is ever evicted);
- a cancelled request ends with finish reason "cancelled".
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import time
from typing import Hashable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rjax import engine
from rjax.cache import init_cache
from rjax.config import ModelConfig
from rjax.memory import kv_bytes_per_position, plan_memory
from rjax.model import Params
from rjax.paged_cache import PageAllocator, init_paged_cache, set_block_tables
from rjax.precompile import Program, compile_programs
from rjax.sampling import SamplingParams
from rjax.serving_events import Completion, StreamEvent, TokenLogprob, token_logprob
from rjax.serving_limits import ServingConfig, check_request, check_stop_ids
from rjax.slots import decode_dispatch, free_slots, init_slots, prefill_into_slots, stop_slots


def _put(*host_arrays):
    """NumPy arrays to the device as a plain transfer: `jnp.asarray` of a NumPy array compiles
    a small `stage` program for every new shape, which a running server must not do."""
    out = jax.device_put(host_arrays)
    return out[0] if len(out) == 1 else out


@dataclasses.dataclass
class _Request:
    request_id: Hashable
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop_ids: tuple[int, ...]
    submitted_s: float
    seed: int = 0             # 64 bits: the request's random stream
    sample_index: int = 0
    logprobs: bool = False
    slot: int = -1
    length: int = 0           # positions the request holds in its slot
    # Positions it may write at most: the prompt and every generated token but the last.
    length_limit: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    token_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    first_token_s: float = 0.0


class ServingEngine:
    """Continuous batching over one model: `submit` requests, then iterate `run()` (or call
    `step()`) for (request_id, new tokens, finished) events. Not thread-safe beyond `submit` and
    `cancel`, which may be called from another thread while the serving thread steps."""

    def __init__(self, cfg: ModelConfig, params: Params, config: ServingConfig = ServingConfig(), *,
                 stop_ids: Sequence[int] = (), seed: int = 0, available_bytes: int | None = None,
                 budget_bytes: int | None = None, reserve_bytes: int | None = None):
        """stop_ids: the default stop set of every request (usually the tokenizer's end-of-sequence
        ids). available_bytes / budget_bytes / reserve_bytes: see `rjax.memory.plan_memory`; the
        cache is checked against the free memory before it is allocated (MemoryFitError)."""
        if config.max_len > cfg.context_length:
            raise ValueError(f"ServingConfig.max_len {config.max_len} exceeds the model's context length "
                             f"{cfg.context_length}")
        self.cfg, self.params, self.config = cfg, params, config
        self.default_stop_ids = check_stop_ids(cfg, config, stop_ids)
        plan_memory(cfg, max_len=config.max_len, page_size=config.page_size, n_slots=config.n_slots,
                    n_pages=config.pool_pages if config.paged else None, prefill_tokens=config.max_prefill_tokens,
                    prefill_prompts=config.max_prefill_prompts, dtype=config.kv_dtype, reserve_bytes=reserve_bytes,
                    available=available_bytes, budget_bytes=budget_bytes)
        dtype = jnp.dtype(config.kv_dtype)
        if config.paged:
            self.cache = init_paged_cache(cfg, config.n_slots, config.pool_pages, config.page_size, config.max_len,
                                          dtype)
            self.pages: PageAllocator | None = PageAllocator(config.pool_pages, config.n_slots, config.max_pages,
                                                             config.page_size)
        else:
            self.cache = init_cache(cfg, config.n_slots, config.max_len, dtype)
            self.pages = None
        self._seeds = np.random.default_rng(seed)  # seeds of the requests that bring none
        self.slots = init_slots(config.n_slots, config.max_stop_ids)
        self._queue: collections.deque[_Request] = collections.deque()
        self._cancels: collections.deque = collections.deque()  # request ids; deque appends are thread-safe
        self._free = list(range(config.n_slots))  # a heap: the lowest free slot is taken first
        self._running: dict[int, _Request] = {}                # slot -> request
        self._ids = itertools.count()
        self._live_ids: set = set()                           # ids of queued and running requests
        self.kv_bytes = (config.pool_pages * config.page_size if config.paged else config.n_slots * config.max_len) \
            * kv_bytes_per_position(cfg, dtype)

    # -- compiling ahead --------------------------------------------------------------------

    def prefill_shapes(self, prompt_lengths: Sequence[int] | None = None) -> list[tuple[int, int]]:
        """The (prompt count bucket, prompt length bucket) pairs admission can form: a single
        prompt of any length that fits, and packs of prompts within `max_prefill_tokens`.
        `prompt_lengths`: only the buckets of these lengths (default: every bucket that fits)."""
        c = self.config
        longest = engine.prompt_bucket(c.max_len - 1)
        lengths = [t for t in engine.PROMPT_BUCKETS if t <= longest] if prompt_lengths is None else \
            sorted({engine.prompt_bucket(min(max(int(n), 1), c.max_len - 1)) for n in prompt_lengths})
        counts = sorted({c.prefill_bucket(n) for n in range(1, min(c.n_slots, c.max_prefill_prompts) + 1)})
        return [(p, t) for p in counts for t in lengths if p == 1 or p * t <= c.max_prefill_tokens]

    def precompile(self, prompt_lengths: Sequence[int] | None = None, workers: int | None = None,
                   progress: bool = False, logprobs: bool = False):
        """Compile the programs `step` calls (the decode dispatch, also its log-probability
        variant with `logprobs`, and every prefill shape of
        `prefill_shapes(prompt_lengths)`) concurrently, before any request: a server pays its
        compile time at start-up rather than on its first requests. -> rjax.precompile.CompileReport."""
        c, n = self.config, self.config.n_slots
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        u32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.uint32)  # noqa: E731
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
        programs = [Program(f"decode B={n} N={c.steps_per_dispatch}{' logprobs' if lp else ''}", decode_dispatch,
                            (self.cfg, self.params, self.cache, self.slots, c.steps_per_dispatch, lp))
                    for lp in ((False, True) if logprobs else (False,))]
        for p, t in self.prefill_shapes(prompt_lengths):
            programs.append(Program(f"prefill P={p} T={t}", prefill_into_slots, (
                self.cfg, self.params, self.cache, self.slots, i32(p, t), i32(p), i32(p),
                jax.ShapeDtypeStruct((p,), jnp.bool_), u32(p, 2), u32(p),
                SamplingParams(f32(p), i32(p), f32(p)), i32(p), i32(p, c.max_stop_ids))))
        return compile_programs(programs, workers, progress=progress)

    # -- requests ---------------------------------------------------------------------------

    def check_request(self, prompt: Sequence[int], *, max_new_tokens: int = 256, temperature: float = 0.0,
                      top_k: int = 0, top_p: float = 1.0, stop_ids: Sequence[int] | None = None,
                      seed: int | None = None, sample_index: int = 0,
                      logprobs: bool = False) -> tuple[list[int], tuple[int, ...]]:
        """Raise ValueError (or TypeError) for a request `submit` would refuse (see
        `rjax.serving_limits`); reads only the engine's fixed settings, so any thread may call
        it. -> (the prompt, the request's stop ids), as ints."""
        return check_request(self.cfg, self.config, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, stop_ids=self.default_stop_ids if stop_ids is None else stop_ids,
                             seed=seed, sample_index=sample_index, logprobs=logprobs)

    def submit(self, prompt: Sequence[int], *, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, stop_ids: Sequence[int] | None = None, request_id: Hashable = None,
               seed: int | None = None, sample_index: int = 0, logprobs: bool = False) -> Hashable:
        """Queue a tokenized prompt. -> its request id (`request_id`, or a new integer).
        Raises ValueError (or TypeError) for a request that could never run (`check_request`)
        or whose id is already queued or running, and then changes nothing.

        seed: the request's random stream (any integer, taken modulo 2**64; None: one drawn from
        the engine's seed); sample_index: folded into that stream, so several samples of one
        seed differ. logprobs: its events carry TokenLogprob entries, one per token."""
        prompt, stops = self.check_request(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                           top_k=top_k, top_p=top_p, stop_ids=stop_ids, seed=seed,
                                           sample_index=sample_index, logprobs=logprobs)
        if request_id is None:
            request_id = next(self._ids)
            while request_id in self._live_ids:
                request_id = next(self._ids)
        elif request_id in self._live_ids:
            raise ValueError(f"request id {request_id!r} is already queued or running")
        seed = int(self._seeds.integers(0, 2 ** 64, dtype=np.uint64)) if seed is None else int(seed) % 2 ** 64
        self._live_ids.add(request_id)
        # The checks keep this within max_len - 1: one slot's table, which the pool can hold.
        limit = len(prompt) + max_new_tokens - 1
        self._queue.append(_Request(request_id, prompt, int(max_new_tokens), float(temperature), int(top_k),
                                    float(top_p), stops, time.perf_counter(), seed, int(sample_index), bool(logprobs),
                                    length_limit=limit))
        return request_id

    def cancel(self, request_id: Hashable) -> None:
        """Stop a queued or running request: at the start of the next `step` it leaves the queue,
        or its slot and pages are freed, and the step reports it finished with reason
        "cancelled". Safe from any thread; an unknown or already finished id is ignored."""
        self._cancels.append(request_id)

    @property
    def n_queued(self) -> int:
        return len(self._queue)

    @property
    def n_running(self) -> int:
        return len(self._running)

    @property
    def n_free_slots(self) -> int:
        return len(self._free)

    @property
    def pages_in_use(self) -> int | None:
        """KV pages that sequences hold now (None for a contiguous cache)."""
        return None if self.pages is None else self.pages.n_pages - self.pages.n_free

    @property
    def has_work(self) -> bool:
        return bool(self._queue or self._running or self._cancels)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> Iterator[StreamEvent]:
        """Step until every submitted request (including ones submitted meanwhile) has finished."""
        while self.has_work:
            yield from self.step()

    def step(self) -> list[StreamEvent]:
        """Apply cancellations, admit and prefill what fits, then one decode dispatch.
        -> the events it produced."""
        events = self._apply_cancels()
        events += self._prefill_new()
        if self._running:
            events += self._decode()
        return events

    def _apply_cancels(self) -> list[StreamEvent]:
        ids = set()
        while self._cancels:
            ids.add(self._cancels.popleft())
        ids &= self._live_ids
        if not ids:
            return []
        queued = [r for r in self._queue if r.request_id in ids]
        for r in queued:
            self._queue.remove(r)
            self._live_ids.discard(r.request_id)
        running = [r for r in self._running.values() if r.request_id in ids]
        if running:
            self.slots = stop_slots(self.slots, _put(self._slot_rows([r.slot for r in running])))
        now = time.perf_counter()
        events = [self._event(r, [], True, now, reason="cancelled") for r in queued + running]
        self._release(running)
        return events

    def _take_admissible(self) -> list[_Request]:
        c, batch = self.config, []
        room = min(len(self._free), c.max_prefill_prompts)
        while self._queue and len(batch) < room:
            req = self._queue[0]
            longest = max([len(r.prompt) for r in batch] + [len(req.prompt)])
            if batch and c.prefill_bucket(len(batch) + 1) * engine.prompt_bucket(longest) \
                    > c.max_prefill_tokens:
                break
            if self.pages is not None:
                need = self.pages.pages_for(req.length_limit)
                if need > self.pages.unreserved:
                    break  # first come, first served: it waits for pages, and so do those behind it
            self._queue.popleft()
            req.slot = heapq.heappop(self._free)
            if self.pages is not None:
                self.pages.reserve(req.slot, self.pages.pages_for(req.length_limit))
                self.pages.grow(req.slot, len(req.prompt))
            batch.append(req)
        return batch

    def _slot_rows(self, slots: list[int]) -> np.ndarray:
        """`slots` padded to n_slots entries with the out-of-range index n_slots (ignored by the
        updates), so that every update of a few slots is one compiled program."""
        rows = np.full(self.config.n_slots, self.config.n_slots, np.int32)
        rows[: len(slots)] = slots
        return rows

    def _sync_block_tables(self, slots: list[int]) -> None:
        if not slots:
            return
        rows = self._slot_rows(slots)
        tables = self.pages.tables[np.minimum(rows, self.config.n_slots - 1)]
        self.cache = set_block_tables(self.cache, *_put(rows, tables))

    def _prefill_new(self) -> list[StreamEvent]:
        batch = self._take_admissible()
        if not batch:
            return []
        c = self.config
        if self.pages is not None:
            self._sync_block_tables([r.slot for r in batch])
        P = c.prefill_bucket(len(batch))
        tokens, lengths = engine.pad_prompts([r.prompt for r in batch])
        tokens = np.pad(tokens, ((0, P - len(batch)), (0, 0)))
        lengths = np.pad(lengths, (0, P - len(batch)))  # padding prompts: length 0, nothing written
        rows = np.full(P, batch[0].slot, np.int32)
        rows[: len(batch)] = [r.slot for r in batch]
        valid = np.arange(P) < len(batch)
        pad = [batch[0]] * (P - len(batch))
        sp = SamplingParams(*_put(np.asarray([r.temperature for r in batch + pad], np.float32),
                                  np.asarray([r.top_k for r in batch + pad], np.int32),
                                  np.asarray([r.top_p for r in batch + pad], np.float32)))
        stops = np.full((P, c.max_stop_ids), -1, np.int32)
        for i, r in enumerate(batch):
            stops[i, : len(r.stop_ids)] = r.stop_ids
        budget = np.asarray([r.max_new_tokens for r in batch + pad], np.int32)
        seeds = np.asarray([[r.seed & 0xFFFFFFFF, r.seed >> 32] for r in batch + pad], np.uint32)
        index = np.asarray([r.sample_index for r in batch + pad], np.uint32)
        first, lp, self.slots, self.cache = prefill_into_slots(
            self.cfg, self.params, self.cache, self.slots, *_put(tokens, lengths, rows, valid, seeds, index), sp,
            *_put(budget, stops))
        first = np.asarray(first)
        done = np.asarray(self.slots.state.done)
        # Only what a request asked for crosses to the host.
        lp = jax.tree.map(np.asarray, lp) if any(r.logprobs for r in batch) else None
        now = time.perf_counter()
        events = []
        for i, r in enumerate(batch):
            r.first_token_s = now
            r.length = len(r.prompt)
            self._running[r.slot] = r
            entries = [token_logprob(lp, i, None, int(first[i]))] if r.logprobs else None
            events.append(self._add_tokens(r, [int(first[i])], entries, bool(done[r.slot]), now))
        self._release([r for r in batch if done[r.slot]])
        return events

    def _decode(self) -> list[StreamEvent]:
        c = self.config
        if self.pages is not None:
            grown = [s for s, r in self._running.items()
                     if self.pages.grow(s, min(r.length + c.steps_per_dispatch, r.length_limit))]
            self._sync_block_tables(grown)
        want_lp = any(r.logprobs for r in self._running.values())
        out, lp, self.slots, self.cache = decode_dispatch(self.cfg, self.params, self.cache, self.slots,
                                                          c.steps_per_dispatch, want_lp)
        out = np.asarray(out)
        done = np.asarray(self.slots.state.done)
        lp = jax.tree.map(np.asarray, lp) if want_lp else None
        now = time.perf_counter()
        events, finished = [], []
        for s, r in list(self._running.items()):
            steps = [i for i, t in enumerate(out[s]) if t >= 0]
            new = [int(out[s, i]) for i in steps]
            r.length += len(new)
            entries = [token_logprob(lp, s, i, int(out[s, i])) for i in steps] if r.logprobs else None
            events.append(self._add_tokens(r, new, entries, bool(done[s]), now))
            if done[s]:
                finished.append(r)
        self._release(finished)
        return events

    def _add_tokens(self, r: _Request, new: list[int], entries: list[TokenLogprob] | None, finished: bool,
                    now: float) -> StreamEvent:
        r.tokens.extend(new)
        if entries is not None:
            r.token_logprobs.extend(entries)
        return self._event(r, new, finished, now, entries)

    def _event(self, r: _Request, new: list[int], finished: bool, now: float,
               entries: list[TokenLogprob] | None = None, reason: str | None = None) -> StreamEvent:
        if r.logprobs and entries is None:
            entries = []
        if not finished:
            return StreamEvent(r.request_id, new, False, logprobs=entries)
        if reason is None:
            reason = "stop" if r.tokens[-1] in r.stop_ids else "length"
        decode_s = now - r.first_token_s
        rate = (len(r.tokens) - 1) / decode_s if decode_s > 0 and len(r.tokens) > 1 else 0.0
        ttft = r.first_token_s - r.submitted_s if r.first_token_s else 0.0
        return StreamEvent(r.request_id, new, True,
                           Completion(r.request_id, r.prompt, list(r.tokens), reason, ttft, rate,
                                      list(r.token_logprobs) if r.logprobs else None), logprobs=entries)

    def _release(self, finished: list[_Request]) -> None:
        if not finished:
            return
        slots = [r.slot for r in finished]
        for s in slots:
            self._live_ids.discard(self._running.pop(s).request_id)
            if self.pages is not None:
                self.pages.release(s)
        self.cache = free_slots(self.cache, _put(self._slot_rows(slots)))
        for s in slots:
            heapq.heappush(self._free, s)


def serve(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], config: ServingConfig = ServingConfig(),
          *, stop_ids: Sequence[int] = (), seed: int = 0, **request) -> list[Completion]:
    """Run every prompt through one ServingEngine (same request settings for all) -> completions in
    prompt order."""
    eng = ServingEngine(cfg, params, config, stop_ids=stop_ids, seed=seed)
    ids = [eng.submit(p, **request) for p in prompts]
    done = {e.request_id: e.completion for e in eng.run() if e.finished}
    return [done[i] for i in ids]
