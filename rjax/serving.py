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

With `ServingConfig.speculative` the decode dispatch drafts and verifies instead
(`rjax.speculative.speculative_dispatch`): by prompt lookup, or with a draft model (`draft=`),
whose own cache (paged: its own pool under the target's block tables) is written with every
prefill chunk and rolled back with the target's.

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

Faults: host-side work of one request that raises (its sampling set-up, its constraint's mask or
advance) ends that request alone with finish reason "error" (`Completion.error` says what
failed); the others go on. A device program that fails (`run_program` raises: out of memory,
say) fails the requests in it; if the failed call took the cache or slot state with it, every
request holding a slot fails and the engine goes on over a fresh cache. Queued requests wait on.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import logging
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
from rjax.paged_cache import init_paged_cache, set_block_tables, set_lengths
from rjax.pages import PageAllocator, PrefixCacheStats, page_hashes
from rjax.precompile import BackgroundCompile, Program, compile_programs
from rjax.sampling import MAX_LOGIT_BIAS, LogitAdjust, SamplingParams, adjusts, penalizes
from rjax.serving_events import Completion, StreamEvent, TokenLogprob, token_logprob
from rjax.serving_limits import ServingConfig, check_request, check_stop_ids
from rjax.tensor_parallel import place_cache
from rjax.slots import (decode_dispatch, free_slots, init_slots, prefill_into_slots, set_masks, start_history,
                        stop_slots)
from rjax.speculative import ModelDrafter, NgramDrafter, check_draft_model, draft_prefill, speculative_dispatch


log = logging.getLogger("rjax.serving")

# `precompile_first` builds the prefill program for one prompt of up to this many tokens first.
FIRST_PROMPT_TOKENS = 128


def run_program(fn, *args):
    """Call one device program of a step and wait for its results, so that a device error
    (XLA's RESOURCE_EXHAUSTED, say), raised by the call or while the program runs, surfaces here
    and not later where some result is read."""
    return jax.block_until_ready(fn(*args))


class DispatchError(RuntimeError):
    """A step's device program failed; `requests` were in it."""

    def __init__(self, program: str, requests, cause: BaseException):
        super().__init__(f"the device failed running {program}: {type(cause).__name__}: {cause}")
        self.program, self.requests, self.cause = program, list(requests), cause


def _fault(what: str, e: BaseException) -> str:
    return f"this request's {what} failed: {type(e).__name__}: {e}"


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
    # Logit adjustments (`rjax.sampling.LogitAdjust.host` keys); empty: none.
    adjust: dict = dataclasses.field(default_factory=dict)
    # The automaton of a constrained request (`rjax.grammar.Constraint`: mask(), advance(token)).
    constraint: object = None
    slot: int = -1
    length: int = 0           # positions the request holds in its slot
    # Positions it may write at most: the prompt and every generated token but the last.
    length_limit: int = 0
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


def check_memory(cfg: ModelConfig, params: Params, config: ServingConfig, draft_cfg: ModelConfig | None = None, *,
                 available_bytes: int | None = None, budget_bytes: int | None = None,
                 reserve_bytes: int | None = None):
    """The memory plan of an engine of `config` (`rjax.memory.plan_memory`), before anything is
    allocated: MemoryFitError where its cache and workspace do not fit."""
    return plan_memory(cfg, max_len=config.max_len, page_size=config.page_size, n_slots=config.n_slots,
                       n_pages=config.pool_pages if config.paged else None, prefill_tokens=config.max_prefill_tokens,
                       prefill_prompts=config.max_prefill_prompts, dtype=config.kv_dtype, reserve_bytes=reserve_bytes,
                       available=available_bytes, budget_bytes=budget_bytes,
                       tp=1 if params.tp is None else params.tp.size, draft_cfg=draft_cfg)


class ServingEngine:
    """Continuous batching over one model: `submit` requests, then iterate `run()` (or call
    `step()`) for (request_id, new tokens, finished) events. Not thread-safe beyond `submit` and
    `cancel`, which may be called from another thread while the serving thread steps."""

    def __init__(self, cfg: ModelConfig, params: Params, config: ServingConfig = ServingConfig(), *,
                 stop_ids: Sequence[int] = (), seed: int = 0, available_bytes: int | None = None,
                 budget_bytes: int | None = None, reserve_bytes: int | None = None,
                 draft: tuple[ModelConfig, Params] | None = None):
        """stop_ids: the default stop set of every request (usually the tokenizer's end-of-sequence
        ids). available_bytes / budget_bytes / reserve_bytes: see `rjax.memory.plan_memory`; the
        cache is checked against the free memory before it is allocated (MemoryFitError).
        draft: (config, params) of the draft model of ServingConfig(speculative="model"), with the
        target's vocabulary; it keeps a cache of its own, of the target's kind and size."""
        if config.max_len > cfg.context_length:
            raise ValueError(f"ServingConfig.max_len {config.max_len} exceeds the model's context length "
                             f"{cfg.context_length}")
        dcfg = self._check_draft(cfg, params, config, draft)
        self.cfg, self.params, self.config = cfg, params, config
        self.default_stop_ids = check_stop_ids(cfg, config, stop_ids)
        check_memory(cfg, params, config, dcfg, available_bytes=available_bytes, budget_bytes=budget_bytes,
                     reserve_bytes=reserve_bytes)
        self.drafter = {None: None, "ngram": NgramDrafter(), "model": ModelDrafter(dcfg) if dcfg else None}[
            config.speculative]
        self.draft_params = draft[1] if dcfg is not None else None
        self.cache = self.draft_cache = None
        self._allocate()
        self._seeds = np.random.default_rng(seed)  # seeds of the requests that bring none
        self._queue: collections.deque[_Request] = collections.deque()
        self._cancels: collections.deque = collections.deque()  # request ids; deque appends are thread-safe
        self._outbox: list[StreamEvent] = []      # events of requests that failed mid-step, for step to return
        self.failed_steps = 0                     # device programs of steps that failed
        self.last_failure: str | None = None
        self._prefilling: list[_Request] = []   # holding a slot, prompt not yet all in the cache (in order)
        self._running: dict[int, _Request] = {}                # slot -> request (decoding)
        # Pages that admitted prompts are computing, by content hash: a prompt that would compute
        # one of them again waits a step and shares it instead.
        self._computing: collections.Counter[bytes] = collections.Counter()
        self._ids = itertools.count()
        self._live_ids: set = set()                           # ids of queued and running requests
        self._drafted = self._accepted = 0                    # speculative totals of finished requests
        per_position = kv_bytes_per_position(cfg, config.kv_dtype) + \
            (kv_bytes_per_position(dcfg, config.kv_dtype) if dcfg else 0)   # the draft model's cache too
        self._background: BackgroundCompile | None = None  # precompile_first's programs still building
        self._building: dict[tuple, str] = {}                # every program's name, by what it is for
        self.kv_bytes = (config.pool_pages * config.page_size if config.paged else config.n_slots * config.max_len) \
            * per_position

    @staticmethod
    def _check_draft(cfg: ModelConfig, params: Params, config: ServingConfig, draft) -> ModelConfig | None:
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
        dcfg, dparams = draft
        check_draft_model(cfg, None, dcfg, None, "given as draft")
        if config.max_len > dcfg.context_length:
            raise ValueError(f"draft: the draft model's context of {dcfg.context_length} tokens is shorter than "
                             f"ServingConfig.max_len {config.max_len}")
        return dcfg

    def _allocate(self) -> None:
        """A fresh cache, slot state and page pool, every slot free (the old buffers are dropped
        first). The draft model's cache is its own pool (paged: with the target's block tables,
        set together, so a page shared by prefix holds the draft's K/V of the same tokens), and
        each slot's pending token (rjax.speculative), both carried between dispatches."""
        c = self.config
        self.cache = self.draft_cache = self.pending = None
        self.cache = self._new_cache(self.cfg, self.params)
        self.pages: PageAllocator | None = None
        if c.paged:
            self.pages = PageAllocator(c.pool_pages, c.n_slots, c.max_pages, c.page_size, prefix_cache=c.prefix_cache)
        if self.draft_params is not None:
            self.draft_cache = self._new_cache(self.drafter.cfg, self.draft_params)
            self.pending = jnp.full((c.n_slots,), -1, jnp.int32)
        self.slots = init_slots(c.n_slots, c.max_stop_ids, self.cfg.vocab_size)
        self._free = list(range(c.n_slots))  # a heap: the lowest free slot is taken first

    def _new_cache(self, cfg: ModelConfig, params: Params):
        """An empty cache for `cfg` of this engine's kind, slots, pages and dtypes."""
        c = self.config
        if c.paged:
            cache = init_paged_cache(cfg, c.n_slots, c.pool_pages, c.page_size, c.max_len, c.dtype,
                                     kv_dtype=c.cache_kv_dtype)
        else:
            cache = init_cache(cfg, c.n_slots, c.max_len, c.dtype, kv_dtype=c.cache_kv_dtype)
        return place_cache(cache, params.tp)

    # -- compiling ahead --------------------------------------------------------------------

    def prefill_shapes(self, prompt_lengths: Sequence[int] | None = None) -> list[tuple[int, int]]:
        """The (prompt count bucket, chunk length bucket) pairs a prefill call can take: a
        prompt longer than `chunk_tokens` goes in chunks of that many, and a call packs chunks
        within `max_prefill_tokens`. `prompt_lengths`: only the chunks of prompts of these
        lengths (default: every bucket up to a chunk)."""
        c = self.config
        if prompt_lengths is None:
            longest = engine.prompt_bucket(min(c.max_len - 1, c.chunk_tokens))
            lengths = [t for t in engine.PROMPT_BUCKETS if t <= longest]
        else:
            chunks = set()
            for n in prompt_lengths:
                n = min(max(int(n), 1), c.max_len - 1)
                chunks.add(min(n, c.chunk_tokens))
                if n > c.chunk_tokens and n % c.chunk_tokens:
                    chunks.add(n % c.chunk_tokens)
            lengths = sorted({engine.prompt_bucket(n) for n in chunks})
        counts = sorted({c.prefill_bucket(n) for n in range(1, min(c.n_slots, c.max_prefill_prompts) + 1)})
        return [(p, t) for p in counts for t in lengths if p == 1 or p * t <= c.max_prefill_tokens]

    def _programs(self, prompt_lengths: Sequence[int] | None = None, logprobs: bool = False) -> dict[tuple, Program]:
        """The programs `step` may call, by what they are for: ("decode", batch, steps, logprobs,
        greedy, filters, adjust), ("speculative", batch, greedy), ("catch-up", batch),
        ("prefill", prompts, tokens) (with a draft model: also ("draft prefill", prompts, tokens))."""
        c = self.config
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        u32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.uint32)  # noqa: E731
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
        # Sampling (with and without top-k / top-p filters) and greedy variants, and the one with
        # logit adjustments and masks (see _sampling), also of one step, which constrained
        # requests decode by (the host computes each next mask). Adjusted with log-probabilities,
        # a rarer mix, compiles on first use.
        N = c.steps_per_dispatch
        plain = ((False, True, ""), (False, False, " unfiltered"), (True, True, " greedy"))
        variants = [(N, lp, g, f, False, name) for lp in ((False, True) if logprobs else (False,))
                    for g, f, name in plain]
        variants += [(n, False, False, True, True, " adjusted") for n in sorted({N, 1})]
        programs = {("decode", b, n, lp, g, f, a): Program(
            f"decode B={b} N={n}{' logprobs' if lp else ''}{name}", decode_dispatch,
            (self.cfg, self.params, self.cache, self.slots, n, lp, i32(b) if c.paged else None, g, f, a))
            for b in c.decode_buckets for n, lp, g, f, a, name in variants}
        model = isinstance(self.drafter, ModelDrafter)
        if c.speculative:
            programs |= {("speculative", b, g): Program(
                f"speculative B={b} K={c.draft_tokens} N={c.steps_per_dispatch}{' greedy' if g else ''}",
                speculative_dispatch, (self.cfg, self.params, self.cache, self.slots, self.drafter, self.draft_params,
                                       (self.draft_cache, self.pending) if model else (i32(b, c.max_len + 1), i32(b)),
                                       c.draft_tokens, c.steps_per_dispatch, i32(b) if c.paged else None, g))
                for b in c.decode_buckets for g in (False, True)}
        shapes = self.prefill_shapes(prompt_lengths)
        if model and logprobs:  # the draft cache catching up after plain decoding (unless a prefill shape)
            T = self._catch_up_tokens
            programs |= {("catch-up", b): Program(f"draft catch-up P={b} T={T}", draft_prefill,
                                                  (self.drafter.cfg, self.draft_params, self.draft_cache, self.pending,
                                                   i32(b, T), i32(b), i32(b)))
                         for b in c.decode_buckets if (b, T) not in shapes}
        for p, t in shapes:
            programs["prefill", p, t] = Program(f"prefill P={p} T={t}", prefill_into_slots, (
                self.cfg, self.params, self.cache, self.slots, i32(p, t), i32(p), i32(p),
                jax.ShapeDtypeStruct((p,), jnp.bool_), u32(p, 2), u32(p),
                SamplingParams(f32(p), i32(p), f32(p)), i32(p), i32(p, c.max_stop_ids),
                LogitAdjust(f32(p), f32(p), f32(p), f32(p), i32(p, MAX_LOGIT_BIAS), f32(p, MAX_LOGIT_BIAS)),
                i32(p, self.slots.mask.shape[1])))
            if model:
                programs["draft prefill", p, t] = Program(f"draft prefill P={p} T={t}", draft_prefill, (
                    self.drafter.cfg, self.draft_params, self.draft_cache, self.pending, i32(p, t), i32(p), i32(p)))
        return programs


    def precompile(self, prompt_lengths: Sequence[int] | None = None, workers: int | None = None,
                   progress: bool = False, logprobs: bool = False):
        """Compile the programs `step` calls (the decode dispatch, also its log-probability
        variant with `logprobs`; the speculative dispatch; every prefill shape of
        `prefill_shapes(prompt_lengths)`; a draft model's prefill, and with `logprobs` its
        catch-up) concurrently, before any request: a server pays its compile time at start-up
        rather than on its first requests. -> rjax.precompile.CompileReport."""
        return compile_programs(list(self._programs(prompt_lengths, logprobs).values()), workers, progress=progress)

    def precompile_first(self, logprobs: bool = False, workers: int | None = None, background_workers: int = 1,
                         first_tokens: int = FIRST_PROMPT_TOKENS):
        """Compile now what a first request of ordinary size needs (one prompt of up to
        `first_tokens` tokens, greedy or sampled without top-k / top-p, decoding alone), and the
        rest of `precompile`'s programs in `background_workers` threads while the engine serves
        (`compiling` names those not yet built). Until a program is built, a call that needs it
        runs in a larger one that is built (a prompt padded further, a batch padded to more
        rows, a sampled program for greedy rows), or waits for it; the log says which.
        -> the CompileReport of the first programs."""
        c, programs = self.config, self._programs(None, logprobs)
        P, B, N = c.prefill_bucket(1), c.decode_buckets[0], c.steps_per_dispatch
        T = max((t for p, t in self.prefill_shapes() if p == P and t <= engine.prompt_bucket(first_tokens)),
                default=engine.PROMPT_BUCKETS[0])
        first = {("prefill", P, T), ("draft prefill", P, T), ("decode", B, N, False, True, True, False),
                 ("decode", B, N, False, False, False, False), ("speculative", B, True), ("speculative", B, False)}
        report = compile_programs([p for k, p in programs.items() if k in first], workers)
        self._building = {k: p.name for k, p in programs.items()}
        self._background = BackgroundCompile([p for k, p in programs.items() if k not in first], background_workers)
        return report

    @property
    def compiling(self) -> list[str]:
        """Programs `precompile_first` left to build in the background, not yet built."""
        return [] if self._background is None else self._background.pending

    def stop_compiling(self) -> None:
        """Start no more of the background's programs (an engine being replaced or shut down)."""
        if self._background is not None:
            self._background.cancel()

    def _built(self, key: tuple) -> bool:
        name = self._building.get(key)
        return name is None or self._background.is_built(name)

    def _program(self, key: tuple, what: str, substitutes: Sequence[tuple] = ()) -> tuple:
        """The program to call for `key`: itself once built, else the first built of
        `substitutes` (programs that compute the same for these rows), else itself after
        waiting for it. Logs which, while programs are still compiling in the background."""
        if self._built(key):
            return key
        name = self._building[key]
        for sub in substitutes:
            if sub in self._building and self._built(sub):
                log.info("%s runs in %s while %s compiles", what, self._building[sub], name)
                return sub
        t = time.perf_counter()
        self._background.wait(name)
        log.info("%s waited %.1f s for %s to compile", what, time.perf_counter() - t, name)
        return key

    # -- requests ---------------------------------------------------------------------------

    def check_request(self, prompt: Sequence[int], *, max_new_tokens: int = 256, temperature: float = 0.0,
                      top_k: int = 0, top_p: float = 1.0, stop_ids: Sequence[int] | None = None,
                      seed: int | None = None, sample_index: int = 0, logprobs: bool = False,
                      **adjust) -> tuple[list[int], tuple[int, ...]]:
        """Raise ValueError (or TypeError) for a request `submit` would refuse (see
        `rjax.serving_limits`); reads only the engine's fixed settings, so any thread may call
        it. -> (the prompt, the request's stop ids), as ints."""
        return check_request(self.cfg, self.config, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, stop_ids=self.default_stop_ids if stop_ids is None else stop_ids,
                             seed=seed, sample_index=sample_index, logprobs=logprobs, adjust=_adjust_keys(adjust))

    def submit(self, prompt: Sequence[int], *, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, stop_ids: Sequence[int] | None = None, request_id: Hashable = None,
               seed: int | None = None, sample_index: int = 0, logprobs: bool = False, constraint=None,
               **adjust) -> Hashable:
        """Queue a tokenized prompt. -> its request id (`request_id`, or a new integer).
        Raises ValueError (or TypeError) for a request that could never run (`check_request`)
        or whose id is already queued or running, and then changes nothing.

        seed: the request's random stream (any integer, taken modulo 2**64; None: one drawn from
        the engine's seed); sample_index: folded into that stream, so several samples of one
        seed differ. logprobs: its events carry TokenLogprob entries, one per token.
        adjust: presence_penalty, frequency_penalty, repetition_penalty, min_p, logit_bias
        ({token id: bias}), as the OpenAI API and vLLM define them (`rjax.sampling.adjust_logits`).
        constraint: a fresh `rjax.grammar.Constraint` (or anything with its mask() and
        advance(token)): every token the request generates is one its mask allows. While a
        constrained request runs, a decode dispatch is one step, for the host to compute the
        next mask."""
        prompt, stops = self.check_request(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                           top_k=top_k, top_p=top_p, stop_ids=stop_ids, seed=seed,
                                           sample_index=sample_index, logprobs=logprobs, **adjust)
        adjust = _adjust_keys(adjust)
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
                                    adjust if adjusts(**adjust) else {}, constraint, length_limit=limit))
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
        """Requests holding a slot: decoding, or with their prompt still being prefilled."""
        return len(self._running) + len(self._prefilling)

    @property
    def n_free_slots(self) -> int:
        return len(self._free)

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
    def has_work(self) -> bool:
        return bool(self._queue or self._prefilling or self._running or self._cancels)

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
            events += self._prefill_new()
        except DispatchError as e:
            events += self._dispatch_failed(e)
        if self._running:
            try:
                events += self._decode()
            except DispatchError as e:
                events += self._dispatch_failed(e)
        events, self._outbox = events + self._outbox, []
        return events

    def _run(self, program: str, requests, fn, *args):
        """`run_program`, its failure a DispatchError naming the program and its requests."""
        try:
            return run_program(fn, *args)
        except Exception as e:
            raise DispatchError(program, requests, e) from e

    def _dispatch_failed(self, e: DispatchError) -> list[StreamEvent]:
        """The requests of a failed device program fail, their slots and pages freed. If the
        failed call took the cache or slot state with it (donated to it, or results it never
        computed), so does every request holding a slot, and the engine starts over a fresh
        cache; queued requests wait on either way."""
        self.failed_steps += 1
        self.last_failure = str(e)
        lost = not self._device_state_ok()
        failed = {id(r): r for r in e.requests if r.request_id in self._live_ids}
        if lost:
            failed |= {id(r): r for r in self._prefilling + list(self._running.values())}
        failed = list(failed.values())
        log.error("%s; %s; failed request(s): %s", e, "the cache and slot state were lost with it and are allocated "
                  "afresh" if lost else "the cache is intact", ", ".join(repr(r.request_id) for r in failed) or "none")
        now = time.perf_counter()
        in_it = {id(r) for r in e.requests}
        events = [self._event(r, [], True, now, reason="error", error=f"{e} (this request was in it)"
                              if id(r) in in_it else f"{e}, and with it the KV cache of this request")
                  for r in failed]
        if lost:
            for r in failed:
                self._live_ids.discard(r.request_id)
            self._prefilling, self._running = [], {}
            self._computing.clear()
            self._allocate()
        else:
            self._stop_slots(failed)
            self._release(failed)
        return events

    def _device_state_ok(self) -> bool:
        """Whether the cache and slot state are still whole: not donated to a call that failed,
        and not the results of one."""
        leaves = jax.tree.leaves((self.cache, self.slots, self.draft_cache, self.pending))
        if any(x.is_deleted() for x in leaves):
            return False
        try:
            jax.block_until_ready(leaves)
        except Exception:
            return False
        return True

    def _fail(self, faults: list[tuple[_Request, str]]) -> None:
        """End requests holding a slot whose own host-side work raised, each alone with finish
        reason "error" (its events go out with the step's), freeing their slots and pages."""
        if not faults:
            return
        now = time.perf_counter()
        for r, what in faults:
            log.error("request %r failed: %s", r.request_id, what)
        held = [r for r, _ in faults]
        self._stop_slots(held)
        self._outbox += [self._event(r, [], True, now, reason="error", error=what) for r, what in faults]
        self._release(held)

    def _stop_slots(self, held: list[_Request]) -> None:
        """Mark the decoding slots of `held` done on the device, so no dispatch writes them."""
        if any(r.slot in self._running for r in held):
            self.slots = stop_slots(self.slots, _put(self._slot_rows([r.slot for r in held])))

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
        held = [r for r in self._prefilling + list(self._running.values()) if r.request_id in ids]
        self._stop_slots(held)
        now = time.perf_counter()
        events = [self._event(r, [], True, now, reason="cancelled") for r in queued + held]
        self._release(held)
        return events

    def _admit(self) -> None:
        """Queued requests into free slots, first come first served, while the pool can promise
        each every page it may need. With the prefix cache a request's table starts with the
        cached pages of its prompt's prefix; a request that would compute a page another
        admitted prompt is computing waits (next step it shares it)."""
        c, shared_rows = self.config, []
        while self._queue and self._free:
            req, shared = self._queue[0], []
            if self.pages is not None:
                if self.pages.prefix_cache and req.hashes is None:
                    req.hashes = page_hashes(req.prompt, c.page_size, len(req.prompt) // c.page_size)
                matchable = (req.hashes or [])[: (len(req.prompt) - 1) // c.page_size]
                shared = self.pages.match_hashes(matchable)
                if len(shared) < len(matchable) and self._computing[matchable[len(shared)]]:
                    break
                need = self.pages.pages_for(req.length_limit)
                if not self.pages.fits(need, shared):
                    break  # it waits for pages, and so do those behind it
            self._queue.popleft()
            req.slot = heapq.heappop(self._free)
            if self.pages is not None:
                self.pages.reserve(req.slot, need, shared)
                req.prefilled = len(shared) * c.page_size
                req.computing = (req.hashes or [])[len(shared):]
                self._computing.update(req.computing)
                if shared:
                    shared_rows.append(req)
            self._prefilling.append(req)
            if penalizes(**req.adjust):  # before any prefill: its first token is penalized too
                prompt = np.full(c.max_len, -1, np.int32)
                prompt[: len(req.prompt)] = req.prompt
                self.slots = start_history(self.slots, np.int32(req.slot), _put(prompt))
        if shared_rows:
            self._sync_block_tables([r.slot for r in shared_rows])
            rows, lengths = _put(self._slot_rows([r.slot for r in shared_rows]),
                                 self._slot_values([r.prefilled for r in shared_rows]))
            self.cache = set_lengths(self.cache, rows, lengths)
            if self.draft_cache is not None:
                self.draft_cache = set_lengths(self.draft_cache, rows, lengths)
                for r in shared_rows:
                    r.draft_length = r.prefilled

    def _chunks(self) -> list[tuple[_Request, int]]:
        """(request, prompt tokens) for the next prefill call: the prefilling requests in order,
        each with its next chunk, packed within `max_prefill_tokens`."""
        c, batch, longest = self.config, [], 0
        for r in self._prefilling[: c.max_prefill_prompts]:
            n = min(len(r.prompt) - r.prefilled, c.chunk_tokens)
            if batch and c.prefill_bucket(len(batch) + 1) * engine.prompt_bucket(max(longest, n)) \
                    > c.max_prefill_tokens:
                break
            batch.append((r, n))
            longest = max(longest, n)
        return batch

    def _slot_values(self, values: list[int]) -> np.ndarray:
        """Per-slot values padded as `_slot_rows` pads their slots."""
        out = np.zeros(self.config.n_slots, np.int32)
        out[: len(values)] = values
        return out

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
        rows, tables = _put(rows, tables)
        self.cache = set_block_tables(self.cache, rows, tables)
        if self.draft_cache is not None:
            self.draft_cache = set_block_tables(self.draft_cache, rows, tables)

    def _prefill_new(self) -> list[StreamEvent]:
        """Admit what fits, then one prefill call: the next chunk of each prefilling request.
        A request whose last chunk this is samples its first token and starts decoding."""
        self._admit()
        batch = self._chunks()
        # Each request's host-side set-up, alone: one that raises fails by itself.
        setup, faults = {}, []
        for r, n in batch:
            try:
                adjust_rows = LogitAdjust.host([r.adjust])
            except Exception as e:
                faults.append((r, _fault("sampling set-up", e)))
                continue
            try:
                last_chunk = r.prefilled + n == len(r.prompt)
                setup[id(r)] = adjust_rows, r.constraint.mask() if last_chunk and r.constraint is not None else None
            except Exception as e:
                faults.append((r, _fault("constraint", e)))
        if faults:
            self._fail(faults)
            batch = [(r, n) for r, n in batch if id(r) in setup]
        if not batch:
            return []
        c = self.config
        reqs = [r for r, _ in batch]
        if self.pages is not None:
            self._sync_block_tables([r.slot for r, n in batch if self.pages.grow(r.slot, r.prefilled + n)])
        P, T = c.prefill_bucket(len(batch)), engine.prompt_bucket(max(n for _, n in batch))
        if self._background is not None:
            P, T = self._prefill_shape(P, T)
        tokens, lengths = engine.pad_prompts([r.prompt[r.prefilled:r.prefilled + n] for r, n in batch], T)
        tokens = np.pad(tokens, ((0, P - len(batch)), (0, 0)))
        lengths = np.pad(lengths, (0, P - len(batch)))  # padding prompts: length 0, nothing written
        rows = np.full(P, reqs[0].slot, np.int32)
        rows[: len(batch)] = [r.slot for r in reqs]
        # A chunk before a prompt's last is written and advances the slot, but starts nothing.
        last = [r.prefilled + n == len(r.prompt) for r, n in batch]
        valid = np.pad(np.asarray(last, bool), (0, P - len(batch)))
        pad = [reqs[0]] * (P - len(batch))
        sp = SamplingParams(*_put(np.asarray([r.temperature for r in reqs + pad], np.float32),
                                  np.asarray([r.top_k for r in reqs + pad], np.int32),
                                  np.asarray([r.top_p for r in reqs + pad], np.float32)))
        stops = np.full((P, c.max_stop_ids), -1, np.int32)
        for i, r in enumerate(reqs):
            stops[i, : len(r.stop_ids)] = r.stop_ids
        budget = np.asarray([r.max_new_tokens for r in reqs + pad], np.int32)
        seeds = np.asarray([[r.seed & 0xFFFFFFFF, r.seed >> 32] for r in reqs + pad], np.uint32)
        index = np.asarray([r.sample_index for r in reqs + pad], np.uint32)
        adjust = LogitAdjust(*_put(*(np.concatenate(field) for field in zip(*(setup[id(r)][0] for r in reqs + pad)))))
        masks = np.full((P, self.slots.mask.shape[1]), -1, np.int32)
        for i, r in enumerate(reqs):
            if setup[id(r)][1] is not None:
                masks[i] = setup[id(r)][1]
        tokens, lengths, rows = _put(tokens, lengths, rows)
        first, lp, self.slots, self.cache = self._run(
            f"prefill P={P} T={T}", reqs, prefill_into_slots, self.cfg, self.params, self.cache, self.slots, tokens,
            lengths, rows, *_put(valid, seeds, index), sp, *_put(budget, stops), adjust, _put(masks))
        if self.draft_cache is not None:  # the draft model writes every position the target writes
            self.draft_cache, self.pending = self._run(
                f"draft prefill P={P} T={T}", reqs, draft_prefill, self.drafter.cfg, self.draft_params,
                self.draft_cache, self.pending, tokens, lengths, rows)
        for r, n in batch:
            r.prefilled += n
            r.draft_length, r.pending = r.prefilled, False
            self._index(r, r.prompt[: r.prefilled])
        started = [(i, r) for i, (r, done_) in enumerate(zip(reqs, last)) if done_]
        if not started:
            return []
        self._prefilling = [r for r in self._prefilling if r.prefilled < len(r.prompt)]
        first = np.asarray(first)
        done = np.asarray(self.slots.state.done)
        # Only what a request asked for crosses to the host.
        lp = jax.tree.map(np.asarray, lp) if any(r.logprobs for _, r in started) else None
        now = time.perf_counter()
        events, finished, faults = [], [], []
        for i, r in started:
            r.first_token_s = now
            r.length = len(r.prompt)
            self._running[r.slot] = r
            entries = [token_logprob(lp, i, None, int(first[i]))] if r.logprobs else None
            if r.constraint is not None:
                try:
                    r.constraint.advance(int(first[i]))
                except Exception as e:
                    faults.append((r, _fault("constraint", e)))
                    continue
            events.append(self._add_tokens(r, [int(first[i])], entries, bool(done[r.slot]), now))
            if done[r.slot]:
                finished.append(r)
        self._release(finished)
        self._fail(faults)
        return events

    def _prefill_shape(self, P: int, T: int) -> tuple[int, int]:
        """(prompts, tokens) of a prefill call of P prompts of up to T tokens while programs
        compile in the background: its own, or a larger one already built (the padding rows
        and positions write nothing). A draft model's prefill has to match, so it waits."""
        shapes = [] if isinstance(self.drafter, ModelDrafter) else sorted(
            ((p, t) for k, p, t in (k for k in self._building if k[0] == "prefill") if p >= P and t >= T),
            key=lambda pt: pt[0] * pt[1])
        key = self._program(("prefill", P, T), f"a prefill of {P} prompt(s) of up to {T} tokens",
                            [("prefill", p, t) for p, t in shapes])
        if not self._built(("draft prefill", P, T)):
            self._program(("draft prefill", P, T), f"a draft prefill of {P} prompt(s) of up to {T} tokens")
        return key[1], key[2]

    def _index(self, r: _Request, tokens: list[int]) -> None:
        """Offer the full pages of `r`'s slot holding `tokens` to the prefix cache, and stop
        counting those it computed as in progress."""
        if self.pages is None or not self.pages.prefix_cache:
            return
        self.pages.register(r.slot, tokens)
        written = len(tokens) // self.config.page_size - (len(r.hashes) - len(r.computing))
        self._uncount(r, max(written, 0))

    def _uncount(self, r: _Request, n: int) -> None:
        """The first n pages `r` was computing are written (or will never be)."""
        for h in r.computing[:n]:
            self._computing[h] -= 1
            if not self._computing[h]:
                del self._computing[h]
        r.computing = r.computing[n:]

    def _decode(self) -> list[StreamEvent]:
        c = self.config
        if c.speculative and not any(r.logprobs or r.adjust or r.constraint for r in self._running.values()):
            return self._decode_speculative()
        masks, faults = {}, []   # each constrained slot's next mask; a constraint that raises fails alone
        for s, r in self._running.items():
            if r.constraint is not None:
                try:
                    masks[s] = r.constraint.mask()
                except Exception as e:
                    faults.append((r, _fault("constraint", e)))
        self._fail(faults)
        if not self._running:
            return []
        if self.pages is not None:
            grown = [s for s, r in self._running.items()
                     if self.pages.grow(s, min(r.length + c.steps_per_dispatch, r.length_limit))]
            self._sync_block_tables(grown)
        want_lp = any(r.logprobs for r in self._running.values())
        constrained = {s: r for s, r in self._running.items() if r.constraint is not None}
        B, n = c.decode_bucket(len(self._running)), 1 if constrained else c.steps_per_dispatch
        lp_call, (greedy, filters, adjust) = want_lp, self._sampling()
        if self._background is not None:
            _, B, n, lp_call, greedy, filters, adjust = self._decode_program(B, n, want_lp, greedy, filters, adjust)
        rows = None
        if c.paged:
            running = sorted(self._running)
            rows = _put(np.array(running + [c.n_slots] * (B - len(running)), np.int32))
        if constrained:
            self._set_masks(masks)
        out, lp, self.slots, self.cache = self._run(
            f"decode B={B} N={n}{' logprobs' if lp_call else ''}", list(self._running.values()), decode_dispatch,
            self.cfg, self.params, self.cache, self.slots, n, lp_call, rows, greedy, filters, adjust)
        out = np.asarray(out)
        done = np.asarray(self.slots.state.done)
        lp = jax.tree.map(np.asarray, lp) if want_lp else None
        now = time.perf_counter()
        events, finished, faults = [], [], []
        for s, r in list(self._running.items()):
            steps = [i for i, t in enumerate(out[s]) if t >= 0]
            new = [int(out[s, i]) for i in steps]
            r.length += len(new)
            if r.constraint is not None:
                try:
                    for t in new:
                        r.constraint.advance(t)
                except Exception as e:
                    faults.append((r, _fault("constraint", e)))
                    continue
            entries = [token_logprob(lp, s, i, int(out[s, i])) for i in steps] if r.logprobs else None
            events.append(self._add_tokens(r, new, entries, bool(done[s]), now))
            if done[s]:
                finished.append(r)
        self._release(finished)
        self._fail(faults)
        return events

    def _decode_program(self, B: int, n: int, lp: bool, greedy: bool, filters: bool, adjust: bool) -> tuple:
        """The decode dispatch to call while programs compile in the background: its own, or a
        built one that gives these rows the same tokens: more rows (padding rows are done), the
        log-probability variant, a sampled program for greedy rows, the filtering one for rows
        without top-k / top-p."""
        variants = [(greedy, filters)] + ([(False, False), (False, True)] if greedy else
                                          [(False, True)] if not filters else [])
        subs = [] if adjust else [("decode", b, n, l, g, f, False) for b in self.config.decode_buckets if b >= B
                                  for l in {lp, True} for g, f in variants]
        return self._program(("decode", B, n, lp, greedy, filters, adjust), f"a decode dispatch of {B} row(s)", subs)

    def _all_greedy(self) -> bool:
        """Whether every running request decodes at temperature 0: the dispatch then runs the
        program without sampling (see `decode_dispatch`); slots not running are done, and what
        they would sample is dropped."""
        return all(r.temperature == 0 for r in self._running.values())

    def _sampling(self) -> tuple[bool, bool, bool]:
        """decode_dispatch's (greedy, filters, adjust) for the running requests: greedy alone, or
        sampling with the search that top-k / top-p need only where a sampled request uses them;
        logit adjustments only where a request has them (then in the one general program,
        whose greedy rows take the argmax: one more program to compile, not four)."""
        if any(r.adjust or r.constraint is not None for r in self._running.values()):
            return False, True, True
        if self._all_greedy():
            return True, True, False
        return False, any(r.temperature > 0 and (r.top_k > 0 or r.top_p < 1) for r in self._running.values()), False

    def _set_masks(self, masks: dict) -> None:
        """Each constrained slot's mask of its next token ({slot: mask}), onto the device."""
        c = self.config
        rows = self._slot_rows(list(masks))
        host = np.full((c.n_slots, self.slots.mask.shape[1]), -1, np.int32)
        for i, mask in enumerate(masks.values()):
            host[i] = mask
        self.slots = set_masks(self.slots, *_put(rows, host))

    def _decode_speculative(self) -> list[StreamEvent]:
        """`_decode` by speculative rounds: every running slot drafts from its own tokens (held
        here and sent along; a slot's history is the prompt and its tokens so far), or all slots
        together with the draft model over its own cache; one forward pass per round verifies
        all slots' drafts, and each slot keeps what it accepted. A step with a request that asked
        for log-probabilities decodes plainly instead (both keep the same per-slot state, so
        requests move between them freely; the draft cache, left behind meanwhile, catches up
        before the next speculative dispatch)."""
        c, K = self.config, self.config.draft_tokens
        if self.pages is not None:
            grown = [s for s, r in self._running.items()
                     if self.pages.grow(s, min(r.length + c.steps_per_dispatch * (K + 1), r.length_limit))]
            self._sync_block_tables(grown)
        # As _decode: a paged engine runs only its running slots, padded to a decode bucket.
        order = sorted(self._running) if c.paged else list(range(c.n_slots))
        B = c.decode_bucket(len(order)) if c.paged else c.n_slots
        if self._background is not None:
            self._program(("speculative", B, self._all_greedy()), f"a speculative dispatch of {B} row(s)")
        rows = _put(np.array(order + [c.n_slots] * (B - len(order)), np.int32)) if c.paged else None
        model = isinstance(self.drafter, ModelDrafter)
        if model:
            self._catch_up_draft()
            draft = (self.draft_cache, self.pending)
        else:
            hist = np.zeros((B, c.max_len + 1), np.int32)
            n_hist = np.zeros(B, np.int32)
            for i, s in enumerate(order):
                if s in self._running:
                    seq = self._running[s].prompt + self._running[s].tokens
                    hist[i, : len(seq)] = seq
                    n_hist[i] = len(seq)
            draft = _put(hist, n_hist)
        out, drafted, accepted, self.slots, self.cache, draft = self._run(
            f"speculative B={B} K={K} N={c.steps_per_dispatch}", list(self._running.values()), speculative_dispatch,
            self.cfg, self.params, self.cache, self.slots, self.drafter, self.draft_params, draft, K,
            c.steps_per_dispatch, rows, self._all_greedy())
        out, drafted, accepted = np.asarray(out), np.asarray(drafted), np.asarray(accepted)
        done = np.asarray(self.slots.state.done)
        if model:
            self.draft_cache, self.pending = draft
            draft_lengths, pending = np.asarray(self.draft_cache.lengths), np.asarray(self.pending)
            for s, r in self._running.items():
                r.draft_length, r.pending = int(draft_lengths[s]), bool(pending[s] >= 0)
        now = time.perf_counter()
        events, finished = [], []
        for s, r in list(self._running.items()):
            new = [int(t) for t in out[s] if t >= 0]
            r.length += len(new)
            r.drafted += int(drafted[s])
            r.accepted += int(accepted[s])
            events.append(self._add_tokens(r, new, None, bool(done[s]), now))
            if done[s]:
                finished.append(r)
        self._release(finished)
        return events

    @property
    def _catch_up_tokens(self) -> int:
        """Tokens per slot of a draft catch-up call: what one plain dispatch decodes, and the
        pending token (a longer lag takes several calls)."""
        return engine.prompt_bucket(self.config.steps_per_dispatch + 1)

    def _catch_up_draft(self) -> None:
        """Write into the draft model's cache the positions its slots lack (decoded plainly, for a
        request that asked for log-probabilities, while the draft model stood by), so that every
        slot's draft cache holds its target length, or that less the pending token."""
        c, T = self.config, self._catch_up_tokens
        while True:
            behind = [r for r in self._running.values() if r.length - r.draft_length > r.pending]
            if not behind:
                return
            P = c.decode_bucket(len(behind))
            if self._background is not None:
                self._program(("draft prefill", P, T) if (P, T) in self.prefill_shapes() else ("catch-up", P),
                              f"a draft catch-up of {P} row(s)")
            chunks = [(r.prompt + r.tokens)[r.draft_length: min(r.length, r.draft_length + T)] for r in behind]
            tokens = np.zeros((P, T), np.int32)
            lengths = np.zeros(P, np.int32)   # padding rows: length 0, nothing written
            rows = np.full(P, behind[0].slot, np.int32)
            for i, (r, chunk) in enumerate(zip(behind, chunks)):
                tokens[i, : len(chunk)], lengths[i], rows[i] = chunk, len(chunk), r.slot
            self.draft_cache, self.pending = self._run(
                f"draft catch-up P={P} T={T}", behind, draft_prefill, self.drafter.cfg, self.draft_params,
                self.draft_cache, self.pending, *_put(tokens, lengths, rows))
            for r, chunk in zip(behind, chunks):
                r.draft_length, r.pending = r.draft_length + len(chunk), False

    @property
    def speculative_stats(self) -> dict:
        """Draft tokens proposed and accepted, over the requests finished so far (speculative decoding)."""
        return dict(drafted=self._drafted, accepted=self._accepted)

    def _add_tokens(self, r: _Request, new: list[int], entries: list[TokenLogprob] | None, finished: bool,
                    now: float) -> StreamEvent:
        r.tokens.extend(new)
        if entries is not None:
            r.token_logprobs.extend(entries)
        return self._event(r, new, finished, now, entries)

    def _event(self, r: _Request, new: list[int], finished: bool, now: float,
               entries: list[TokenLogprob] | None = None, reason: str | None = None,
               error: str | None = None) -> StreamEvent:
        if r.logprobs and entries is None:
            entries = []
        if not finished:
            return StreamEvent(r.request_id, new, False, logprobs=entries)
        if reason is None:
            reason = "stop" if r.tokens[-1] in r.stop_ids else "length"
        decode_s = now - r.first_token_s
        rate = (len(r.tokens) - 1) / decode_s if decode_s > 0 and len(r.tokens) > 1 else 0.0
        ttft = r.first_token_s - r.submitted_s if r.first_token_s else 0.0
        self._drafted += r.drafted
        self._accepted += r.accepted
        return StreamEvent(r.request_id, new, True,
                           Completion(r.request_id, r.prompt, list(r.tokens), reason, ttft, rate,
                                      list(r.token_logprobs) if r.logprobs else None, r.drafted, r.accepted,
                                      error),
                           logprobs=entries)

    def _release(self, finished: list[_Request]) -> None:
        """Free the slots and pages of finished (or cancelled) requests; their full pages stay
        in the prefix cache, holding the prompt and the tokens generated."""
        if not finished:
            return
        slots = [r.slot for r in finished]
        for r in finished:
            self._live_ids.discard(r.request_id)
            self._running.pop(r.slot, None)
            if self.pages is not None:
                # The slot holds the K/V of every token but the last generated (never fed back),
                # or of the chunks prefilled so far; with a draft model, only the pages both
                # caches hold are offered.
                held = r.length or r.prefilled
                if self.draft_cache is not None:
                    held = min(held, r.draft_length)
                self._index(r, (r.prompt + r.tokens)[:held])
                self._uncount(r, len(r.computing))   # a prompt cancelled before all were written
                self.pages.release(r.slot)
        gone = {id(r) for r in finished}
        self._prefilling = [r for r in self._prefilling if id(r) not in gone]
        rows = _put(self._slot_rows(slots))
        self.cache = free_slots(self.cache, rows)
        if self.draft_cache is not None:
            self.draft_cache = free_slots(self.draft_cache, rows)
        for s in slots:
            heapq.heappush(self._free, s)


def _adjust_keys(adjust: dict) -> dict:
    """submit's adjustment arguments -> `LogitAdjust.host` keys (a misspelt one is a TypeError)."""
    names = {"presence_penalty": "presence", "frequency_penalty": "frequency", "repetition_penalty": "repetition",
             "min_p": "min_p", "logit_bias": "logit_bias"}
    unknown = sorted(set(adjust) - set(names))
    if unknown:
        raise TypeError(f"unexpected request argument(s): {', '.join(unknown)}")
    return {names[k]: v for k, v in adjust.items() if v is not None}


def serve(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], config: ServingConfig = ServingConfig(),
          *, stop_ids: Sequence[int] = (), seed: int = 0, **request) -> list[Completion]:
    """Run every prompt through one ServingEngine (same request settings for all) -> completions in
    prompt order."""
    eng = ServingEngine(cfg, params, config, stop_ids=stop_ids, seed=seed)
    ids = [eng.submit(p, **request) for p in prompts]
    done = {e.request_id: e.completion for e in eng.run() if e.finished}
    return [done[i] for i in ids]
