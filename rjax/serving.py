"""Continuous batching over cache slots: a request queue on the host, pure jitted steps on the device.

`ServingEngine` keeps one cache of `n_slots` rows (paged or contiguous) and, per slot, the decode
state, sampling parameters and stop ids as device arrays. Each `step()`:

1. admits queued requests into free slots (first come, first served) and prefills all of them
   in one multi-prompt call, each prompt written straight into its slot;
2. runs one decode dispatch (`decode_dispatch`: `steps_per_dispatch` decode steps, sampling and
   stop conditions in one XLA program, as `engine.decode_loop`) over every slot (free and
   finished slots are masked off);
3. streams the new tokens of every request, and frees the slots of finished ones: their pages
   go back to the free list and the slot's length is reset by a pure function.

Each slot draws from its own random stream, made from its request's seed at admission, so a
seeded request samples the same tokens whatever else runs beside it. Log-probabilities (the
chosen token's and the top `MAX_TOP_LOGPROBS`, of the model's raw distribution) come out of
prefill always (one small top-k per prompt) and out of a decode dispatch only while some running
request asked for them (a second compiled variant of the dispatch, so the plain one pays nothing).
`cancel(request_id)` may be called from any thread; the cancellation is applied at the start of
the next `step`, which frees the request's slot and pages.

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
- a request stops at `max_len` positions with finish reason "context"; a cancelled one ends with
  finish reason "cancelled".
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import itertools
import time
from typing import Hashable, Iterator, NamedTuple, Sequence

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
from rjax.sampling import SamplingParams, sample

# Top log-probabilities a request may ask for per token (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20


def _put(*host_arrays):
    """NumPy arrays to the device as a plain transfer: `jnp.asarray` of a NumPy array compiles
    a small `stage` program for every new shape, which a running server must not do."""
    out = jax.device_put(host_arrays)
    return out[0] if len(out) == 1 else out


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

    state: DecodeState         # last_token, done, remaining [n_slots]; a free slot is done;
    #                            key [n_slots]: one random stream per slot
    sampling: SamplingParams   # [n_slots]
    stop_ids: jax.Array        # [n_slots, max_stop_ids] int32, -1 padded


def init_slots(n_slots: int, max_stop_ids: int) -> SlotBatch:
    # The keys are placeholders: admission gives each slot its request's key.
    state = DecodeState(jnp.zeros((n_slots,), jnp.int32), jnp.ones((n_slots,), bool),
                        jnp.zeros((n_slots,), jnp.int32), jax.random.split(jax.random.key(0), n_slots))
    return SlotBatch(state, SamplingParams.make(n_slots), jnp.full((n_slots, max_stop_ids), -1, jnp.int32))


def request_keys(seeds, sample_index):
    """One key per request from its 64-bit seed (seeds [P, 2] uint32: low and high words) and its
    sample index [P] (n samples of one seed draw apart)."""
    def one(seed, index):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), index)

    return jax.vmap(one)(seeds, sample_index)


def sample_rows(logits, keys, sp: SamplingParams):
    """`rjax.sample` with one key per row: logits [B, V], keys [B] -> (tokens [B] int32, the keys
    advanced). A row's draw depends on its own key alone, not on the rows beside it."""
    pair = jax.vmap(jax.random.split)(keys)
    keys, subs = pair[:, 0], pair[:, 1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        def one(row, key, t, k, p):
            return sample(row[None], key, SamplingParams(t[None], k[None], p[None]))[0]
        return jax.vmap(one)(logits, subs, sp.temperature, sp.top_k, sp.top_p)

    # All-greedy batches (the common serving case) skip the sort that filtered sampling needs.
    sampled = jax.lax.cond(jnp.any(sp.temperature > 0), draw, lambda: greedy)
    return jnp.where(sp.temperature > 0, sampled, greedy).astype(jnp.int32), keys


class TopLogprobs(NamedTuple):
    """Log-probabilities under the model's raw distribution (log_softmax of the logits)."""

    chosen: jax.Array     # [...] the sampled token's
    top_ids: jax.Array    # [..., MAX_TOP_LOGPROBS] int32, most likely first
    top: jax.Array        # [..., MAX_TOP_LOGPROBS]


def top_logprobs(logits, tokens) -> TopLogprobs:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top, ids = jax.lax.top_k(logp, min(MAX_TOP_LOGPROBS, logp.shape[-1]))
    return TopLogprobs(chosen, ids.astype(jnp.int32), top)


def _is_stop(tokens, stop_ids):
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


def admit(slots: SlotBatch, cache, rows, valid, first_tokens, max_new_tokens, sampling: SamplingParams,
          stop_ids, keys) -> SlotBatch:
    """Start the sequences just prefilled into cache rows `rows` [P], whose first tokens are
    `first_tokens` [P] and random streams `keys` [P]; rows with valid False are padding and
    change nothing."""
    new = engine.initial_state(first_tokens, max_new_tokens, stop_ids, keys, cache, rows)
    idx = jnp.where(valid, rows, slots.stop_ids.shape[0])  # padding scatters out of range: dropped

    def put(full, part):
        return full.at[idx].set(part, mode="drop")

    s = slots.state
    state = DecodeState(put(s.last_token, new.last_token), put(s.done, new.done),
                        put(s.remaining, new.remaining), put(s.key, keys))
    return SlotBatch(state, jax.tree.map(put, slots.sampling, sampling), put(slots.stop_ids, stop_ids))


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache", "slots"))
def prefill_into_slots(cfg: ModelConfig, params: Params, cache, slots: SlotBatch, tokens, lengths, rows, valid, seeds,
                       sample_index, sampling: SamplingParams, max_new_tokens, stop_ids):
    """Prefill P prompts (tokens [P, T], lengths [P]; padding prompts have length 0 and valid
    False) into cache rows `rows` [P], sample each first token from its request's key
    (`request_keys(seeds, sample_index)`) and start the sequences with their per-prompt sampling
    parameters, token budgets [P] and stop ids [P, K].
    -> (first tokens [P], their TopLogprobs, slots, cache)."""
    logits, cache = engine.prefill(cfg, params, cache, tokens, lengths, rows)
    first, keys = sample_rows(logits, request_keys(seeds, sample_index), sampling)
    slots = admit(slots, cache, rows, valid, first, max_new_tokens, sampling, stop_ids, keys)
    return first, top_logprobs(logits, first), slots, cache


@functools.partial(jax.jit, static_argnames=("cfg", "n_steps", "logprobs"), donate_argnames=("cache", "slots"),
                   compiler_options=engine.DECODE_LOOP_COMPILER_OPTIONS)
def decode_dispatch(cfg: ModelConfig, params: Params, cache, slots: SlotBatch, n_steps: int, logprobs: bool = False):
    """Up to n_steps decode steps over every slot in one XLA program (`engine.decode_loop` with a
    random stream per slot), stopping early when every slot is done. With `logprobs` (static:
    a second program) also each step's TopLogprobs [n_slots, n_steps, ...].
    -> (tokens [n_slots, n_steps] int32, -1 where nothing was generated; TopLogprobs or None;
    slots; cache)."""
    B = slots.state.last_token.shape[0]
    out0 = jnp.full((B, n_steps), -1, jnp.int32)
    k = min(MAX_TOP_LOGPROBS, cfg.vocab_size)
    lp0 = TopLogprobs(jnp.zeros((B, n_steps)), jnp.zeros((B, n_steps, k), jnp.int32),
                      jnp.zeros((B, n_steps, k))) if logprobs else None

    def cond(carry):
        i, _, _, state, _ = carry
        return (i < n_steps) & ~jnp.all(state.done)

    def body(carry):
        i, out, lp, state, cache = carry
        active = ~state.done & (cache.lengths < cache.max_len)
        logits, cache = engine.decode_step(cfg, params, cache, state.last_token, active)
        tok, keys = sample_rows(logits, state.key, slots.sampling)
        out = out.at[:, i].set(jnp.where(active, tok, -1))
        if logprobs:
            lp = jax.tree.map(lambda full, step: full.at[:, i].set(step), lp, top_logprobs(logits, tok))
        remaining = state.remaining - active.astype(jnp.int32)
        done = state.done | (active & (_is_stop(tok, slots.stop_ids) | (remaining <= 0)
                                       | (cache.lengths >= cache.max_len)))
        state = DecodeState(jnp.where(active, tok, state.last_token), done, remaining, keys)
        return i + 1, out, lp, state, cache

    _, out, lp, state, cache = jax.lax.while_loop(cond, body, (jnp.int32(0), out0, lp0, slots.state, cache))
    return out, lp, dataclasses.replace(slots, state=state), cache


@functools.partial(jax.jit, donate_argnames=("slots",))
def stop_slots(slots: SlotBatch, rows) -> SlotBatch:
    """Mark slots `rows` done (indices >= n_slots are padding), so decoding skips them."""
    state = dataclasses.replace(slots.state, done=slots.state.done.at[rows].set(True, mode="drop"))
    return dataclasses.replace(slots, state=state)


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
class TokenLogprob:
    """One generated token's log-probability and the most likely tokens at its position, under
    the model's raw distribution (before temperature, top-k and top-p)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]   # (token id, log-probability), MAX_TOP_LOGPROBS, most likely first


@dataclasses.dataclass(frozen=True)
class Completion:
    request_id: Hashable
    prompt: list[int]
    tokens: list[int]
    # "stop" (a stop id), "length" (max_new_tokens), "context" (max_len) or "cancelled"
    finish_reason: str
    ttft_s: float             # from submit to the first token on the host (0 if it never had one)
    decode_tokens_per_s: float
    logprobs: list[TokenLogprob] | None = None  # one per token, for a request submitted with logprobs


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    request_id: Hashable
    tokens: list[int]         # the request's new tokens (may be empty)
    finished: bool
    completion: Completion | None = None  # set when finished
    logprobs: list[TokenLogprob] | None = None  # one per new token, for a request submitted with logprobs


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
        from rjax.precompile import Program, compile_programs

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

    def _check_stop_ids(self, stop_ids):
        if len(stop_ids) > self.config.max_stop_ids:
            raise ValueError(f"{len(stop_ids)} stop ids; ServingConfig.max_stop_ids is {self.config.max_stop_ids}")
        bad = [t for t in stop_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"stop ids {bad} are outside the vocabulary of {self.cfg.vocab_size}")

    def check_request(self, prompt: Sequence[int], *, max_new_tokens: int = 256, temperature: float = 0.0,
                      top_k: int = 0, top_p: float = 1.0, stop_ids: Sequence[int] | None = None) -> tuple[int, ...]:
        """Raise ValueError for a request `submit` would refuse (see the module docstring); reads
        only the engine's fixed settings, so any thread may call it. -> the request's stop ids."""
        c = self.config
        if len(prompt) == 0:
            raise ValueError("empty prompt: at least one token is needed")
        if len(prompt) >= c.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens: ServingConfig.max_len is {c.max_len} positions and "
                             f"generation needs at least one free position")
        bad = [int(t) for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary of {self.cfg.vocab_size}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        SamplingParams.make(1, temperature, top_k, top_p)  # validates
        stops = self.default_stop_ids if stop_ids is None else tuple(int(t) for t in stop_ids)
        self._check_stop_ids(stops)
        return stops

    def submit(self, prompt: Sequence[int], *, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, stop_ids: Sequence[int] | None = None, request_id: Hashable = None,
               seed: int | None = None, sample_index: int = 0, logprobs: bool = False) -> Hashable:
        """Queue a tokenized prompt. -> its request id (`request_id`, or a new integer).
        Raises ValueError for a request that could never run (see the module docstring).

        seed: the request's random stream (any integer, taken modulo 2**64; None: one drawn from
        the engine's seed); sample_index: folded into that stream, so several samples of one
        seed differ. logprobs: its events carry TokenLogprob entries, one per token."""
        prompt = [int(t) for t in prompt]
        c = self.config
        stops = self.check_request(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, stop_ids=stop_ids)
        if not 0 <= sample_index < 2 ** 32:
            raise ValueError(f"sample_index must be in [0, 2**32), got {sample_index}")
        seed = int(self._seeds.integers(0, 2 ** 64, dtype=np.uint64)) if seed is None else int(seed) % 2 ** 64
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
                                    stops, time.perf_counter(), seed, int(sample_index), bool(logprobs),
                                    length_limit=limit))
        return rid

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
            entries = [_token_logprob(lp, i, None, int(first[i]))] if r.logprobs else None
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
            entries = [_token_logprob(lp, s, i, int(out[s, i])) for i in steps] if r.logprobs else None
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
            reason = "stop" if r.tokens[-1] in r.stop_ids else "length" if len(r.tokens) >= r.max_new_tokens \
                else "context"
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


def _token_logprob(lp: TopLogprobs, row: int, step: int | None, token: int) -> TokenLogprob:
    """The host copy of one token's TopLogprobs (prefill's [P, ...] when step is None, else a
    decode dispatch's [n_slots, n_steps, ...])."""
    at = (row,) if step is None else (row, step)
    ids, top = lp.top_ids[at], lp.top[at]
    return TokenLogprob(token, float(lp.chosen[at]), tuple((int(i), float(v)) for i, v in zip(ids, top)))


def serve(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], config: ServingConfig = ServingConfig(),
          *, stop_ids: Sequence[int] = (), seed: int = 0, **request) -> list[Completion]:
    """Run every prompt through one ServingEngine (same request settings for all) -> completions in
    prompt order."""
    eng = ServingEngine(cfg, params, config, stop_ids=stop_ids, seed=seed)
    ids = [eng.submit(p, **request) for p in prompts]
    done = {e.request_id: e.completion for e in eng.run() if e.finished}
    return [done[i] for i in ids]
