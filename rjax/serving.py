"""Continuous batching over cache slots: a request queue on the host, pure jitted steps on the device.

`ServingEngine` keeps one cache of `n_slots` rows (paged or contiguous) and, per slot, the decode
state, sampling parameters and stop ids as device arrays. Each `step()`:

1. admits queued requests into free slots (first come, first served) and prefills all of them
   in one multi-prompt call, each prompt written straight into its slot;
2. runs one `engine.decode_loop` dispatch of `steps_per_dispatch` steps over every slot (free
   and finished slots are masked off);
3. streams the new tokens of every request, and frees the slots of finished ones: their pages
   go back to the free list and the slot's length is reset by a pure function.

A slot index is data, never a static argument, and sampling parameters are per-slot arrays, so
admitting a request with other settings into any slot reuses the compiled programs. Prompt
counts and lengths are padded to buckets, which bounds the number of programs.

Limits (`ServingConfig`), and what happens beyond them:
- a request whose prompt does not leave one free position in `max_len` (or with an empty prompt,
  token ids outside the vocabulary, too many stop ids, bad sampling settings) is refused by
  `submit` with a ValueError, and nothing changes;
- more requests than free slots, or than free pages, wait in the queue (admission reserves the
  pages a request may need at most, so a running sequence never runs out of pages and no
  sequence is ever evicted);
- a request stops at `max_len` positions with finish reason "context".
"""
from __future__ import annotations

import collections
import dataclasses
import functools
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
from rjax.engine import DecodeState
from rjax.memory import kv_bytes_per_position, plan_memory
from rjax.model import Params
from rjax.paged_cache import PageAllocator, PagedKVCache, init_paged_cache, set_block_tables
from rjax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    n_slots: int = 32
    max_len: int = 2048                 # positions per sequence (prompt + generated)
    page_size: int | None = 16          # None: a contiguous cache [L, n_slots, Hkv, max_len, D]
    n_pages: int | None = None          # page pool size; None: every slot can reach max_len
    steps_per_dispatch: int = 8
    # Prompt counts a prefill call is padded to (one compiled program each); the last is the most
    # prompts packed into one call.
    prefill_buckets: tuple[int, ...] = (1, 2, 4, 8, 16)
    max_prefill_tokens: int = 4096      # padded tokens per prefill call (one longer prompt still runs alone)
    max_stop_ids: int = 8               # stop ids per request
    kv_dtype: str = "float32"

    def __post_init__(self):
        for name in ("n_slots", "max_len", "steps_per_dispatch", "max_prefill_tokens", "max_stop_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServingConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.prefill_buckets or list(self.prefill_buckets) != sorted(set(self.prefill_buckets)) \
                or self.prefill_buckets[0] < 1:
            raise ValueError(f"ServingConfig.prefill_buckets must be increasing counts >= 1, got {self.prefill_buckets}")
        if self.page_size is not None:
            if self.page_size < 1 or self.page_size & (self.page_size - 1):
                raise ValueError(f"ServingConfig.page_size must be a power of two, got {self.page_size}")
            if self.max_len % self.page_size:
                raise ValueError(f"ServingConfig.max_len {self.max_len} is not a multiple of page_size {self.page_size}")
            if self.n_pages is not None and self.n_pages < self.max_pages:
                raise ValueError(f"ServingConfig.n_pages {self.n_pages} cannot hold one sequence of max_len "
                                 f"{self.max_len} ({self.max_pages} pages of {self.page_size})")
        elif self.n_pages is not None:
            raise ValueError("ServingConfig.n_pages needs a page_size")

    @property
    def max_prefill_prompts(self) -> int:
        return self.prefill_buckets[-1]

    def prefill_bucket(self, n_prompts: int) -> int:
        return next(b for b in self.prefill_buckets if b >= n_prompts)

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def max_pages(self) -> int:
        return self.max_len // self.page_size

    @property
    def pool_pages(self) -> int:
        return self.n_slots * self.max_pages if self.n_pages is None else self.n_pages


def fit_config(cfg: ModelConfig, *, max_len: int, page_size: int | None = 16, n_slots: int | None = None,
               tokens_per_slot: int | None = None, params_bytes: int = 0, reserve_bytes: int | None = None,
               available: int | None = None, budget_bytes: int | None = None, **settings) -> ServingConfig:
    """A ServingConfig whose slots (unless given) and pages are what the device's free memory
    holds (see `rjax.memory.plan_memory`); raises MemoryFitError when not even one sequence fits."""
    base = ServingConfig(n_slots=n_slots or 1, max_len=max_len, page_size=page_size, **settings)
    plan = plan_memory(cfg, max_len=max_len, page_size=page_size, n_slots=n_slots, tokens_per_slot=tokens_per_slot,
                       prefill_tokens=base.max_prefill_tokens, prefill_prompts=base.max_prefill_prompts,
                       dtype=base.kv_dtype, params_bytes=params_bytes, reserve_bytes=reserve_bytes,
                       available=available, budget_bytes=budget_bytes)
    return dataclasses.replace(base, n_slots=plan.n_slots, n_pages=plan.n_pages)


# ---------------------------------------------------------------------------------------------
# device side: per-slot state and the pure functions that update it

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotBatch:
    """Everything per slot that the decode loop reads, as arrays over all slots."""

    state: DecodeState         # last_token, done, remaining [n_slots]; a free slot is done
    sampling: SamplingParams   # [n_slots]
    stop_ids: jax.Array        # [n_slots, max_stop_ids] int32, -1 padded


def init_slots(n_slots: int, max_stop_ids: int, key: jax.Array) -> SlotBatch:
    state = DecodeState(jnp.zeros((n_slots,), jnp.int32), jnp.ones((n_slots,), bool),
                        jnp.zeros((n_slots,), jnp.int32), key)
    return SlotBatch(state, SamplingParams.make(n_slots), jnp.full((n_slots, max_stop_ids), -1, jnp.int32))


def admit(slots: SlotBatch, cache, rows, valid, first_tokens, max_new_tokens, sampling: SamplingParams,
          stop_ids) -> SlotBatch:
    """Start the sequences just prefilled into cache rows `rows` [P], whose first tokens are
    `first_tokens` [P]; rows with valid False are padding and change nothing."""
    new = engine.initial_state(first_tokens, max_new_tokens, stop_ids, slots.state.key, cache, rows)
    idx = jnp.where(valid, rows, slots.stop_ids.shape[0])  # padding scatters out of range: dropped

    def put(full, part):
        return full.at[idx].set(part, mode="drop")

    s = slots.state
    state = DecodeState(put(s.last_token, new.last_token), put(s.done, new.done),
                        put(s.remaining, new.remaining), s.key)
    return SlotBatch(state, jax.tree.map(put, slots.sampling, sampling), put(slots.stop_ids, stop_ids))


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache", "slots"))
def prefill_into_slots(cfg: ModelConfig, params: Params, cache, slots: SlotBatch, tokens, lengths, rows, valid, key,
                       sampling: SamplingParams, max_new_tokens, stop_ids):
    """Prefill P prompts (tokens [P, T], lengths [P]; padding prompts have length 0 and valid
    False) into cache rows `rows` [P], sample each first token and start the sequences with
    their per-prompt sampling parameters, token budgets [P] and stop ids [P, K].
    -> (first tokens [P], slots, cache)."""
    first, cache = engine.prefill_and_sample(cfg, params, cache, tokens, lengths, rows, key, sampling)
    return first, admit(slots, cache, rows, valid, first, max_new_tokens, sampling, stop_ids), cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def free_slots(cache, rows):
    """Empty cache rows `rows` (indices >= n_slots are padding): length 0, and no pages for a
    paged cache. A contiguous row keeps its old entries, but nothing reads past a row's length."""
    if isinstance(cache, PagedKVCache):
        return cache.reset(rows)
    return dataclasses.replace(cache, lengths=cache.lengths.at[rows].set(0, mode="drop"))


# ---------------------------------------------------------------------------------------------
# host side

@dataclasses.dataclass(frozen=True)
class Completion:
    request_id: Hashable
    prompt: list[int]
    tokens: list[int]
    finish_reason: str        # "stop" (a stop id), "length" (max_new_tokens) or "context" (max_len)
    ttft_s: float             # from submit to the first token on the host
    decode_tokens_per_s: float


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    request_id: Hashable
    tokens: list[int]         # the request's new tokens (may be empty)
    finished: bool
    completion: Completion | None = None  # set when finished


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
    slot: int = -1
    length: int = 0           # positions the request holds in its slot
    # Positions it may write at most: the prompt and every generated token but the last.
    length_limit: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    first_token_s: float = 0.0


class ServingEngine:
    """Continuous batching over one model: `submit` requests, then iterate `run()` (or call
    `step()`) for (request_id, new tokens, finished) events. Not thread-safe beyond `submit`,
    which may be called from another thread while the serving thread steps."""

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
        self.default_stop_ids = tuple(int(t) for t in stop_ids)
        self._check_stop_ids(self.default_stop_ids)
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
        key, self._key = jax.random.split(jax.random.key(seed))
        self.slots = init_slots(config.n_slots, config.max_stop_ids, key)
        self._queue: collections.deque[_Request] = collections.deque()
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
                   progress: bool = False):
        """Compile the programs `step` calls (the decode dispatch and every prefill shape of
        `prefill_shapes(prompt_lengths)`) concurrently, before any request: a server pays its
        compile time at start-up rather than on its first requests. -> rjax.precompile.CompileReport."""
        from rjax.precompile import Program, compile_programs

        c, n = self.config, self.config.n_slots
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
        programs = [Program(f"decode B={n} N={c.steps_per_dispatch}", engine.decode_loop,
                            (self.cfg, self.params, self.cache, self.slots.state, self.slots.sampling,
                             self.slots.stop_ids, c.steps_per_dispatch))]
        for p, t in self.prefill_shapes(prompt_lengths):
            programs.append(Program(f"prefill P={p} T={t}", prefill_into_slots, (
                self.cfg, self.params, self.cache, self.slots, i32(p, t), i32(p), i32(p),
                jax.ShapeDtypeStruct((p,), jnp.bool_), jax.eval_shape(lambda: jax.random.key(0)),
                SamplingParams(f32(p), i32(p), f32(p)), i32(p), i32(p, c.max_stop_ids))))
        return compile_programs(programs, workers, progress=progress)

    # -- requests ---------------------------------------------------------------------------

    def _check_stop_ids(self, stop_ids):
        if len(stop_ids) > self.config.max_stop_ids:
            raise ValueError(f"{len(stop_ids)} stop ids; ServingConfig.max_stop_ids is {self.config.max_stop_ids}")
        bad = [t for t in stop_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"stop ids {bad} are outside the vocabulary of {self.cfg.vocab_size}")

    def submit(self, prompt: Sequence[int], *, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, stop_ids: Sequence[int] | None = None, request_id: Hashable = None) -> Hashable:
        """Queue a tokenized prompt. -> its request id (`request_id`, or a new integer).
        Raises ValueError for a request that could never run (see the module docstring)."""
        prompt = [int(t) for t in prompt]
        c = self.config
        if not prompt:
            raise ValueError("empty prompt: at least one token is needed")
        if len(prompt) >= c.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens: ServingConfig.max_len is {c.max_len} positions and "
                             f"generation needs at least one free position")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary of {self.cfg.vocab_size}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        SamplingParams.make(1, temperature, top_k, top_p)  # validates
        stops = self.default_stop_ids if stop_ids is None else tuple(int(t) for t in stop_ids)
        self._check_stop_ids(stops)
        # Never more than one slot's table, which the config guarantees the pool can hold.
        limit = min(len(prompt) + max_new_tokens - 1, c.max_len)
        if request_id is None:
            request_id = next(self._ids)
            while request_id in self._live_ids:
                request_id = next(self._ids)
        elif request_id in self._live_ids:
            raise ValueError(f"request id {request_id!r} is already queued or running")
        rid = request_id
        self._live_ids.add(rid)
        self._queue.append(_Request(rid, prompt, int(max_new_tokens), float(temperature), int(top_k), float(top_p),
                                    stops, time.perf_counter(), length_limit=limit))
        return rid

    @property
    def n_queued(self) -> int:
        return len(self._queue)

    @property
    def n_running(self) -> int:
        return len(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._queue or self._running)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> Iterator[StreamEvent]:
        """Step until every submitted request (including ones submitted meanwhile) has finished."""
        while self.has_work:
            yield from self.step()

    def step(self) -> list[StreamEvent]:
        """Admit and prefill what fits, then one decode dispatch. -> the events it produced."""
        events = self._prefill_new()
        if self._running:
            events += self._decode()
        return events

    def _next_key(self):
        self._key, sub = jax.random.split(self._key)
        return sub

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
        self.cache = set_block_tables(self.cache, jnp.asarray(rows), jnp.asarray(tables))

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
        sp = SamplingParams(jnp.asarray([r.temperature for r in batch + pad], jnp.float32),
                            jnp.asarray([r.top_k for r in batch + pad], jnp.int32),
                            jnp.asarray([r.top_p for r in batch + pad], jnp.float32))
        stops = np.full((P, c.max_stop_ids), -1, np.int32)
        for i, r in enumerate(batch):
            stops[i, : len(r.stop_ids)] = r.stop_ids
        budget = np.asarray([r.max_new_tokens for r in batch + pad], np.int32)
        first, self.slots, self.cache = prefill_into_slots(
            self.cfg, self.params, self.cache, self.slots, jnp.asarray(tokens), jnp.asarray(lengths),
            jnp.asarray(rows), jnp.asarray(valid), self._next_key(), sp, jnp.asarray(budget), jnp.asarray(stops))
        first = np.asarray(first)
        done = np.asarray(self.slots.state.done)
        now = time.perf_counter()
        events = []
        for i, r in enumerate(batch):
            r.tokens.append(int(first[i]))
            r.first_token_s = now
            r.length = len(r.prompt)
            self._running[r.slot] = r
            events.append(self._event(r, [int(first[i])], bool(done[r.slot]), now))
        self._release([r for r in batch if done[r.slot]])
        return events

    def _decode(self) -> list[StreamEvent]:
        c = self.config
        if self.pages is not None:
            grown = [s for s, r in self._running.items()
                     if self.pages.grow(s, min(r.length + c.steps_per_dispatch, r.length_limit))]
            self._sync_block_tables(grown)
        out, state, self.cache = engine.decode_loop(self.cfg, self.params, self.cache, self.slots.state,
                                                    self.slots.sampling, self.slots.stop_ids, c.steps_per_dispatch)
        self.slots = dataclasses.replace(self.slots, state=state)
        out = np.asarray(out)
        done = np.asarray(state.done)
        now = time.perf_counter()
        events, finished = [], []
        for s, r in list(self._running.items()):
            new = [int(t) for t in out[s] if t >= 0]
            r.tokens.extend(new)
            r.length += len(new)
            events.append(self._event(r, new, bool(done[s]), now))
            if done[s]:
                finished.append(r)
        self._release(finished)
        return events

    def _event(self, r: _Request, new: list[int], finished: bool, now: float) -> StreamEvent:
        if not finished:
            return StreamEvent(r.request_id, new, False)
        if r.tokens[-1] in r.stop_ids:
            reason = "stop"
        elif len(r.tokens) >= r.max_new_tokens:
            reason = "length"
        else:
            reason = "context"
        decode_s = now - r.first_token_s
        rate = (len(r.tokens) - 1) / decode_s if decode_s > 0 and len(r.tokens) > 1 else 0.0
        return StreamEvent(r.request_id, new, True,
                           Completion(r.request_id, r.prompt, list(r.tokens), reason, r.first_token_s - r.submitted_s,
                                      rate))

    def _release(self, finished: list[_Request]) -> None:
        if not finished:
            return
        slots = [r.slot for r in finished]
        for s in slots:
            self._live_ids.discard(self._running.pop(s).request_id)
            if self.pages is not None:
                self.pages.release(s)
        self.cache = free_slots(self.cache, jnp.asarray(self._slot_rows(slots)))
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
