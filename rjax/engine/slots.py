"""The device side of continuous batching: per-slot decode state and the pure jitted functions
that update it (`rjax.runtime.serving.ServingEngine` is the host-side scheduler that calls them).

Each slot draws from its own random stream, made from its request's seed at admission, so a
seeded request samples the same tokens whatever else runs beside it. Log-probabilities (the
chosen token's and the top `MAX_TOP_LOGPROBS`, of the model's raw distribution) come out of
prefill always (one small top-k per prompt) and out of a decode dispatch only with `logprobs`
(a second compiled variant of the dispatch, so the plain one pays nothing).

A slot index is data, never a static argument, and sampling parameters are per-slot arrays, so
admitting a request with other settings into any slot reuses the compiled programs. Updates of a
few slots take `rows` padded with the out-of-range index n_slots, which they drop.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rjax.engine import steps
from rjax.engine.steps import DecodeState, request_keys, sample_rows
from rjax.loading.programs import device_program
from rjax.math.config import ModelConfig
from rjax.math.paged_cache import PagedKVCache, put_row_view, row_view
from rjax.math.params import Params
from rjax.math.sampling import MAX_TOP_LOGPROBS  # noqa: F401 (the limit of a request's top_logprobs)
from rjax.math.sampling import PROMPT_BIT, LogitAdjust, SamplingParams, adjust_logits, mask_logits, top_logprobs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotBatch:
    """Everything per slot that the decode loop reads, as arrays over all slots."""

    state: DecodeState         # last_token, done, remaining [n_slots]; a free slot is done;
    #                            key [n_slots]: one random stream per slot
    sampling: SamplingParams   # [n_slots]
    stop_ids: jax.Array        # [n_slots, max_stop_ids] int32, -1 padded
    adjust: LogitAdjust        # [n_slots]: penalties, logit_bias, min-p (neutral: no change)
    # [n_slots, vocab] int32: each slot's token history (`rjax.math.sampling.PROMPT_BIT`), exact only
    # for slots whose request penalizes (`start_history` at admission; `decode_dispatch` with
    # adjust=True keeps it); read only through their penalties, so stale rows change nothing.
    history: jax.Array
    # [n_slots, ceil(vocab / 32)] int32: the tokens each slot may sample next, a bitmask (all
    # ones: any), set by the host between steps for a constrained request (`set_masks`).
    mask: jax.Array


@device_program(static_argnums=(0, 1, 2))
def init_slots(n_slots: int, max_stop_ids: int, vocab_size: int) -> SlotBatch:
    # The keys are placeholders: admission gives each slot its request's key.
    state = DecodeState(jnp.zeros((n_slots,), jnp.int32), jnp.ones((n_slots,), bool),
                        jnp.zeros((n_slots,), jnp.int32), jax.random.split(jax.random.key(0), n_slots))
    return SlotBatch(state, SamplingParams.make(n_slots), jnp.full((n_slots, max_stop_ids), -1, jnp.int32),
                     LogitAdjust.make(n_slots), jnp.zeros((n_slots, vocab_size), jnp.int32),
                     jnp.full((n_slots, (vocab_size + 31) // 32), -1, jnp.int32))


@device_program(donate_argnames=("slots",))
def set_masks(slots: SlotBatch, rows, masks) -> SlotBatch:
    """The token bitmasks of slots `rows` [R] (padding: n_slots, dropped) -> masks [R, words]."""
    return dataclasses.replace(slots, mask=slots.mask.at[rows].set(masks, mode="drop"))


@device_program(donate_argnames=("slots",))
def start_history(slots: SlotBatch, row, prompt) -> SlotBatch:
    """Slot `row`'s history from its prompt (prompt [max_len] int32, -1 padded): nothing
    generated, PROMPT_BIT at each prompt token."""
    V = slots.history.shape[1]
    fresh = jnp.zeros((V,), jnp.int32).at[jnp.where(prompt < 0, V, prompt)].set(PROMPT_BIT, mode="drop")
    return dataclasses.replace(slots, history=slots.history.at[row].set(fresh))


def admit(slots: SlotBatch, cache, rows, valid, first_tokens, max_new_tokens, sampling: SamplingParams,
          stop_ids, keys, adjust: LogitAdjust, mask) -> SlotBatch:
    """Start the sequences just prefilled into cache rows `rows` [P], whose first tokens are
    `first_tokens` [P] and random streams `keys` [P]; rows with valid False are padding and
    change nothing."""
    new = steps.initial_state(first_tokens, max_new_tokens, stop_ids, keys, cache, rows)
    idx = jnp.where(valid, rows, slots.stop_ids.shape[0])  # padding scatters out of range: dropped

    def put(full, part):
        return full.at[idx].set(part, mode="drop")

    s = slots.state
    state = DecodeState(put(s.last_token, new.last_token), put(s.done, new.done),
                        put(s.remaining, new.remaining), put(s.key, keys))
    history = slots.history.at[idx, first_tokens].add(1, mode="drop")
    return SlotBatch(state, jax.tree.map(put, slots.sampling, sampling), put(slots.stop_ids, stop_ids),
                     jax.tree.map(put, slots.adjust, adjust), history, put(slots.mask, mask))


def request_arrays(n: int, seed: int, budget, stop_ids, vocab_size: int):
    """For n requests of one seed (sample indices 0..n-1) in cache rows 0..n-1, token budgets
    [n] and stop ids [K] each, without logit adjustments or masks, what `prefill_into_slots`
    takes beside tokens, lengths, valid and sampling, as device arrays made as the server makes
    them (a plain transfer compiles nothing). -> (rows, seeds, sample_index, (max_new_tokens,
    stop_ids, adjust, mask))."""
    seed %= 2 ** 64
    rows, seeds, index, budget, stops, mask, *adjust = jax.device_put((
        np.arange(n, dtype=np.int32), np.tile(np.asarray([[seed & 0xFFFFFFFF, seed >> 32]], np.uint32), (n, 1)),
        np.arange(n, dtype=np.uint32), np.asarray(budget, np.int32), np.tile(np.asarray(stop_ids, np.int32), (n, 1)),
        np.full((n, (vocab_size + 31) // 32), -1, np.int32), *LogitAdjust.host([{}] * n)))
    return rows, seeds, index, (budget, stops, LogitAdjust(*adjust), mask)


@device_program(static_argnames=("cfg",), donate_argnames=("cache", "slots"))
def prefill_into_slots(cfg: ModelConfig, params: Params, cache, slots: SlotBatch, tokens, lengths, rows, valid, seeds,
                       sample_index, sampling: SamplingParams, max_new_tokens, stop_ids, adjust: LogitAdjust,
                       mask):
    """Prefill P prompts (tokens [P, T], lengths [P]; padding prompts have length 0 and valid
    False) into cache rows `rows` [P], sample each first token from its request's key
    (`request_keys(seeds, sample_index)`) and its logits adjusted (`adjust` [P], with the
    slots' histories) and masked (token bitmasks mask [P, words]), and start the sequences with their per-prompt sampling parameters,
    adjustments, token budgets [P] and stop ids [P, K]. (Once per prompt, the adjustment costs
    little beside the prefill, so no variant leaves it out.)
    -> (first tokens [P], their TopLogprobs of the raw logits, slots, cache)."""
    logits, cache = steps.prefill(cfg, params, cache, tokens, lengths, rows)
    history = slots.history[jnp.minimum(rows, slots.history.shape[0] - 1)]
    z = mask_logits(adjust_logits(logits, adjust, history, sampling.temperature), mask)
    first, keys = sample_rows(z, request_keys(seeds, sample_index), sampling)
    slots = admit(slots, cache, rows, valid, first, max_new_tokens, sampling, stop_ids, keys, adjust, mask)
    return first, top_logprobs(logits, first), slots, cache


def _decode_steps(cfg: ModelConfig, params: Params, cache, slots: SlotBatch, n_steps: int, logprobs: bool,
                  greedy: bool, filters: bool, adjust: bool):
    """`steps.decode_steps` over every row of `cache` and `slots`; with `adjust`, `slots.history`
    holds these rows' histories, carried through the loop."""
    out, lp, state, cache, history = steps.decode_steps(
        cfg, params, cache, slots.state, slots.sampling, slots.stop_ids, n_steps, greedy=greedy, filters=filters,
        logprobs=logprobs, adjust=slots.adjust if adjust else None, history=slots.history, mask=slots.mask)
    return out, lp, dataclasses.replace(slots, state=state, history=history if adjust else slots.history), cache


def take_rows(slots: SlotBatch, cache: PagedKVCache, rows, adjust: bool = False):
    """The slots `rows` [R] (padding: n_slots) as a batch of R: their decode state, and a view of
    the paged cache with their block tables and lengths over the same page pool (no K/V copy).
    A padding row is done, owns no page and holds nothing. The histories ([R, vocab]) and masks
    are taken only with `adjust`; else the batch holds the whole arrays, unread."""
    n = slots.state.last_token.shape[0]
    pad = rows >= n
    idx = jnp.minimum(rows, n - 1)
    sub = jax.tree.map(lambda a: a[idx], dataclasses.replace(slots, history=None, mask=None))
    sub = dataclasses.replace(sub, history=slots.history[idx] if adjust else slots.history,
                              mask=slots.mask[idx] if adjust else slots.mask)
    sub = dataclasses.replace(sub, state=dataclasses.replace(sub.state, done=sub.state.done | pad))
    return sub, row_view(cache, rows)


def put_rows(full, rows, part):
    """full[rows] = part along the leading axis; padding rows (>= the row count) are dropped."""
    return jax.tree.map(lambda f, p: f.at[rows].set(p, mode="drop"), full, part)


@device_program(static_argnames=("cfg", "n_steps", "logprobs", "greedy", "filters", "adjust"),
                   donate_argnames=("cache", "slots"), compiler_options=steps.DECODE_LOOP_COMPILER_OPTIONS)
def decode_dispatch(cfg: ModelConfig, params: Params, cache, slots: SlotBatch, n_steps: int, logprobs: bool = False,
                    rows=None, greedy: bool = False, filters: bool = True, adjust: bool = False):
    """Up to n_steps decode steps in one XLA program (`steps.decode_steps`), stopping early when
    every slot is done. With `logprobs` (static: a second program) also each step's TopLogprobs
    [n_slots, n_steps, ...]. The cache is contiguous (`rjax.math.cache.KVCache`, as `rjax.generate`
    runs one prompt) or paged.

    rows: None to run every slot; or, for a paged cache, the slots to run [R] (padded with
    n_slots), so that a decode step costs a batch of R however many slots the engine has (one
    program per R). A paged slot's K/V lives in the shared pool, so running a subset takes only
    their block tables and lengths.
    greedy (static: a second program): every slot that runs decodes at temperature 0, so each
    step takes the argmax and the loop holds no sampling conditional (which XLA evaluates on the
    host, once a step). The tokens and the state are those of the general program.
    filters (static): False where no slot that runs uses top-k or top-p, so that sampling leaves
    out their search over the vocabulary (`rjax.sample`); the same tokens.
    adjust (static): some slot that runs uses penalties, logit_bias, min-p or a token mask: each
    step adjusts the logits (`rjax.math.sampling.adjust_logits`), masks them (`slots.mask`) and
    counts the sampled tokens into the slots' histories. Without it the program holds none of
    this, and a slot's adjustments and mask are ignored.
    -> (tokens [n_slots, n_steps] int32, -1 where nothing was generated; TopLogprobs or None;
    slots; cache)."""
    if rows is None:
        return _decode_steps(cfg, params, cache, slots, n_steps, logprobs, greedy, filters, adjust)
    if not isinstance(cache, PagedKVCache):
        raise ValueError("decode_dispatch runs a subset of rows only over a paged cache")
    sub, view = take_rows(slots, cache, rows, adjust)
    out, lp, sub, view = _decode_steps(cfg, params, view, sub, n_steps, logprobs, greedy, filters, adjust)
    B = slots.state.last_token.shape[0]
    out = jnp.full((B, n_steps), -1, jnp.int32).at[rows].set(out, mode="drop")
    if logprobs:
        lp = put_rows(jax.tree.map(lambda a: jnp.zeros((B,) + a.shape[1:], a.dtype), lp), rows, lp)
    cache = put_row_view(cache, rows, view)
    history = slots.history.at[rows].set(sub.history, mode="drop") if adjust else slots.history
    slots = dataclasses.replace(slots, state=put_rows(slots.state, rows, sub.state), history=history)
    return out, lp, slots, cache


@device_program(donate_argnames=("slots",))
def stop_slots(slots: SlotBatch, rows) -> SlotBatch:
    """Mark slots `rows` done (indices >= n_slots are padding), so decoding skips them."""
    state = dataclasses.replace(slots.state, done=slots.state.done.at[rows].set(True, mode="drop"))
    return dataclasses.replace(slots, state=state)


@device_program(donate_argnames=("cache",))
def free_slots(cache, rows):
    """Empty cache rows `rows` (indices >= n_slots are padding): length 0, and no pages for a
    paged cache. A contiguous row keeps its old entries, but nothing reads past a row's length."""
    if isinstance(cache, PagedKVCache):
        return cache.reset(rows)
    return dataclasses.replace(cache, lengths=cache.lengths.at[rows].set(0, mode="drop"))

