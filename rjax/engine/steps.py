"""Jitted prefill and decode: pure functions of (static config, params, KV cache, inputs).

The cache is donated to every call, so XLA updates it in place, and a call returns the new
cache. Prompts are padded to a small set of length buckets so a new prompt length reuses a
compiled program; `decode_loop` runs many decode steps (sampling and stop conditions
included) inside one XLA program, which is what CUDA-graph replay is for in other engines.
Only token ids leave the device.

The public functions are device programs (rjax.loading.programs: their executables are kept across
calls and processes) that check their arguments on the host before they dispatch (`_checked`):
shapes always, values (token ids in the vocabulary, room in each slot, slot indices) when the
arrays are concrete, i.e. called outside a jit of the caller's. A bad call raises ValueError
before the cache is donated, so the cache it was given is still valid and unchanged, and the
checks live outside the jitted functions, so they change no compiled program.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rjax.loading.programs import DeviceProgram
from rjax.math import tensor_parallel
from rjax.math.cache import KVCache
from rjax.math.config import ModelConfig
from rjax.engine.memory import host_available_bytes
from rjax.math.model import dense_layers, dense_layers_bytes, hidden_states, logits_from_hidden, plan_of
from rjax.math.params import Params
from rjax.math.plan import TUNING, Tuning
from rjax.math.sampling import (MAX_TOP_LOGPROBS, SamplingParams, TopLogprobs, _is_concrete, adjust_logits,
                                check_sampling, mask_logits, sample, top_logprobs)

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class ContextLengthError(ValueError):
    """A request needs more positions than the model's context or the cache holds."""


class PromptTooLongError(ContextLengthError):
    """A prompt leaves no room to generate in the context or the cache."""


def prompt_bucket(n: int) -> int:
    """The padded length a prompt of n tokens is compiled for."""
    for b in PROMPT_BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"prompt of {n} tokens is longer than the largest bucket {PROMPT_BUCKETS[-1]}")


def _on_mesh(tp, arguments: dict) -> dict:
    """For params split over a mesh: the cache in its layout and every other array replicated
    on the mesh, whatever device made it, so that each call is compiled once (a jitted
    function's cache key holds its arguments' shardings)."""
    replicated = tp.sharding(tensor_parallel.P())

    def put(name, value):
        if name == "cache":
            return tensor_parallel.place_cache(value, tp)
        if name in ("cfg", "params"):
            return value
        return jax.tree.map(lambda x: jax.device_put(x, replicated) if isinstance(x, (jax.Array, np.ndarray))
                            else x, value)

    return {name: put(name, value) for name, value in arguments.items()}


def _placed(arguments: dict) -> dict | None:
    tp = getattr(arguments.get("params"), "tp", None)
    return None if tp is None else _on_mesh(tp, arguments)


def _checked(check, **jit_options):
    """A device program (rjax.loading.programs) behind a host-side check of its arguments; params
    split over a mesh are placed first."""
    return lambda fun: DeviceProgram(fun, check=check, place=_placed, **jit_options)


def _host(x) -> np.ndarray:
    return np.asarray(x)


def _is_int_array(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.integer)


def _check_shape(name: str, x, shape: tuple, what: str) -> None:
    if tuple(np.shape(x)) != shape:
        raise ValueError(f"{name} must be {what} {shape}, got shape {tuple(np.shape(x))}")


def _check_ids(cfg: ModelConfig, name: str, ids: np.ndarray, valid: np.ndarray) -> None:
    """Token ids where `valid` must lie in [0, vocab_size): the embedding lookup would clamp them."""
    bad = valid & ((ids < 0) | (ids >= cfg.vocab_size))
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}{list(at)} = {int(ids[at])} is outside the vocabulary [0, {cfg.vocab_size})")


def _check_prefill(cfg: ModelConfig, cache, tokens, lengths, slots, sp: SamplingParams | None = None) -> None:
    if np.ndim(tokens) != 2 or not _is_int_array(tokens):
        raise ValueError(f"tokens must be integer token ids [prompts, padded length], got "
                         f"{jnp.result_type(tokens)} of shape {tuple(np.shape(tokens))}")
    P, T = np.shape(tokens)
    n = cache.n_slots
    _check_shape("lengths", lengths, (P,), "one length per prompt:")
    if not _is_int_array(lengths):
        raise ValueError(f"lengths must be integers, got {jnp.result_type(lengths)}")
    if slots is None and P > n:
        raise ValueError(f"{P} prompts for a cache of {n} slots: at most one prompt per slot (n_slots={n})")
    if slots is not None:
        _check_shape("slots", slots, (P,), "one cache row per prompt:")
        if not _is_int_array(slots):
            raise ValueError(f"slots must be integers, got {jnp.result_type(slots)}")
    if sp is not None:
        for name in ("temperature", "top_k", "top_p"):
            _check_shape(f"SamplingParams.{name}", getattr(sp, name), (P,), "one value per prompt:")
    if not _is_concrete(cache.lengths, tokens, lengths, slots, sp):
        return  # under the caller's jit: shapes only
    lengths_h = _host(lengths)
    for i, length in enumerate(lengths_h):
        if not 1 <= length <= T:
            what = "is empty: at least one token is needed" if length < 1 else \
                f"is longer than the padded width {T} of tokens"
            raise ValueError(f"prompt {i} (lengths[{i}] = {int(length)}) {what}")
    _check_ids(cfg, "tokens", _host(tokens), np.arange(T)[None, :] < lengths_h[:, None])
    rows = np.arange(P) if slots is None else _host(slots)
    if slots is not None:
        if ((rows < 0) | (rows >= n)).any():
            raise ValueError(f"slots {rows.tolist()} must be cache rows in [0, {n})")
        if len(set(rows.tolist())) != P:
            raise ValueError(f"slots {rows.tolist()} name a cache row twice: one prompt per row")
    held = _host(cache.lengths)[rows]
    for i in range(P):
        if held[i] + lengths_h[i] > cache.max_len:
            raise PromptTooLongError(f"prompt {i} of {int(lengths_h[i])} tokens after the {int(held[i])} positions "
                                     f"slot {int(rows[i])} holds needs {int(held[i] + lengths_h[i])} positions; "
                                     f"the cache has max_len {cache.max_len}")
    if sp is not None:
        check_sampling(_host(sp.temperature), _host(sp.top_k), _host(sp.top_p))


def _rows(cache: KVCache, slots):
    return cache.lengths if slots is None else cache.lengths[slots]


def _prefill_logits(cfg: ModelConfig, params: Params, cache: KVCache, tokens, lengths, slots):
    P, T = tokens.shape
    start = _rows(cache, slots)
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    pos = jnp.where(t < lengths[:, None], start[:, None] + t, -1)
    h, cache = hidden_states(cfg, params, cache, tokens, pos, slots, cache.dtype)
    last = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return logits_from_hidden(params, last), cache.advance(slots, lengths)


@_checked(lambda cfg, params, cache, tokens, lengths, slots: _check_prefill(cfg, cache, tokens, lengths, slots),
          static_argnames=("cfg",), donate_argnames=("cache",))
def prefill(cfg: ModelConfig, params: Params, cache: KVCache, tokens: jax.Array, lengths: jax.Array,
            slots: jax.Array | None = None):
    """Run P prompts (tokens [P, T] right-padded, true lengths [P]) into cache rows `slots` [P]
    (None: rows 0..P-1), appending after what those rows already hold.
    -> (logits at each prompt's last token [P, vocab] float32, cache).

    Refused before dispatch (ValueError, the cache untouched): more prompts than slots, an
    empty prompt, a token id outside the vocabulary, a slot out of range or named twice, and
    (PromptTooLongError) a prompt that does not fit after what its slot holds."""
    return _prefill_logits(cfg, params, cache, tokens, lengths, slots)


def _decode_logits(cfg, params, cache: KVCache, tokens, active, tuning: Tuning = TUNING):
    pos = jnp.where(active, cache.lengths, -1)[:, None]
    plan = plan_of(cfg, params, cache, tokens[:, None], None, cache.dtype, tuning)
    h, cache = hidden_states(cfg, params, cache, tokens[:, None], pos, None, cache.dtype, plan)
    return logits_from_hidden(params, h[:, 0]), cache.advance(None, active.astype(jnp.int32))


def _check_decode_step(cfg, params, cache, tokens, active) -> None:
    n = cache.n_slots
    _check_shape("tokens", tokens, (n,), "one token id per cache slot:")
    if not _is_int_array(tokens):
        raise ValueError(f"tokens must be integer token ids, got {jnp.result_type(tokens)}")
    if active is not None:
        _check_shape("active", active, (n,), "one flag per cache slot:")
    if not _is_concrete(cache.lengths, tokens, active):
        return
    on = np.ones(n, bool) if active is None else _host(active).astype(bool)
    _check_ids(cfg, "tokens", _host(tokens), on)
    held = _host(cache.lengths)
    full = on & (held >= cache.max_len)
    if full.any():
        s = int(np.flatnonzero(full)[0])
        raise ContextLengthError(f"slot {s} holds {int(held[s])} positions, all of the cache's max_len "
                                 f"{cache.max_len}: no room for another token (leave it out with `active`, "
                                 f"or start a longer cache)")


@_checked(_check_decode_step, static_argnames=("cfg",), donate_argnames=("cache",))
def decode_step(cfg: ModelConfig, params: Params, cache: KVCache, tokens: jax.Array, active: jax.Array | None = None):
    """One token for every slot: tokens [n_slots] are appended at each slot's length
    (inactive slots are left untouched). -> (logits [n_slots, vocab] float32, cache).

    Refused before dispatch: a token id outside the vocabulary, and an active slot whose cache
    row is full (ContextLengthError). Those checks read the slot lengths and token ids back,
    which waits for the calls before; under the caller's own jit only shapes are checked, and
    `decode_loop` runs many steps with no host round trip."""
    if active is None:
        active = jnp.ones(tokens.shape, bool)
    return _decode_logits(cfg, params, cache, tokens, active)


@_checked(lambda cfg, params, cache, tokens, lengths, slots, key, sp:
          _check_prefill(cfg, cache, tokens, lengths, slots, sp), static_argnames=("cfg",), donate_argnames=("cache",))
def prefill_and_sample(cfg, params, cache, tokens, lengths, slots, key, sp: SamplingParams):
    """prefill, then sample the first generated token on the device. -> (tokens [P] int32, cache).
    Refuses what `prefill` refuses, and sampling settings out of range."""
    logits, cache = _prefill_logits(cfg, params, cache, tokens, lengths, slots)
    return sample(logits, key, sp), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Per-slot generation state carried from one decode dispatch to the next."""

    last_token: jax.Array  # [B] int32: sampled but not yet in the cache
    done: jax.Array        # [B] bool
    remaining: jax.Array   # [B] int32: tokens each slot may still generate
    key: jax.Array         # [B]: one random stream per slot, so a slot's draws depend on its key alone


def is_stop(tokens, stop_ids):
    """tokens [B]; stop_ids: [K] shared by every slot, or [B, K] one row per slot (pad rows with
    -1). -> [B] bool. Over emitted rounds tokens [B, T] -> [B, T] (stop_ids [B, K])."""
    stop = stop_ids if stop_ids.ndim == 2 else stop_ids[None, :]
    if tokens.ndim == 2:
        return jnp.any(tokens[:, :, None] == stop[:, None, :], axis=-1)
    return jnp.any(tokens[:, None] == stop, axis=-1)


def finished(stopped, remaining, lengths, max_len: int):
    """The one rule for a sequence's end: a stop token, its token budget spent, or its cache row full."""
    return stopped | (remaining <= 0) | (lengths >= max_len)


def initial_state(first_tokens, max_new_tokens, stop_ids, key, cache: KVCache, slots=None) -> DecodeState:
    """State after the first token came out of prefill (it counts as one generated token).
    key: one per slot [B], or a single key, split into one per slot."""
    first_tokens = jnp.asarray(first_tokens, jnp.int32)
    remaining = jnp.broadcast_to(jnp.asarray(max_new_tokens, jnp.int32) - 1, first_tokens.shape)
    if jnp.ndim(key) == 0:
        key = jax.random.split(key, first_tokens.shape[0])
    done = finished(is_stop(first_tokens, stop_ids), remaining, _rows(cache, slots), cache.max_len)
    return DecodeState(first_tokens, done, remaining, key)


def request_keys(seeds, sample_index):
    """One key per request from its 64-bit seed (seeds [P, 2] uint32: low and high words) and its
    sample index [P] (n samples of one seed draw apart)."""
    def one(seed, index):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), index)

    return jax.vmap(one)(seeds, sample_index)


def sample_rows(logits, keys, sp: SamplingParams, greedy_only: bool = False, filters: bool = True):
    """`rjax.sample` with one key per row: logits [B, V], keys [B] -> (tokens [B] int32, the keys
    advanced). A row's draw depends on its own key alone, not on the rows beside it.
    greedy_only: the caller knows every row's temperature is 0, so the program holds the argmax
    alone, without sampling (the keys advance as they would). Neither form holds a
    conditional, which XLA would evaluate on the host. filters=False: no row uses top-k or top-p,
    so the program leaves their search out (`rjax.sample`)."""
    pair = jax.vmap(jax.random.split)(keys)
    keys, subs = pair[:, 0], pair[:, 1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy_only:
        return greedy, keys

    def draw():
        def one(row, key, t, k, p):
            return sample(row[None], key, SamplingParams(t[None], k[None], p[None]), filters)[0]
        return jax.vmap(one)(logits, subs, sp.temperature, sp.top_k, sp.top_p)

    return jnp.where(sp.temperature > 0, draw(), greedy).astype(jnp.int32), keys


# XLA runs a while loop's condition on the host unless the loop is in a command buffer: after
# every decode step the GPU drains and the host reads the predicate back before it launches the
# next step. With WHILE and CONDITIONAL among the command-buffer types, a decode loop is one
# CUDA graph whose conditional nodes test the predicate on the device. The option replaces
# XLA's list, so the list repeats the default types (the gain: docs/kernels.md, "The decode
# step"). A CPU backend ignores it. The loops must hold no custom call that a command buffer
# cannot capture, or they fall back to the host (sampling's filters search rather than sort:
# XLA hands a one-row sort to cub's radix sort, such a call).
DECODE_LOOP_COMPILER_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL",
    "xla_gpu_graph_min_graph_size": 1,
}


def _check_decode_loop(cfg, params, cache, state: DecodeState, sp: SamplingParams, stop_ids, n_steps,
                       tuning, filters: bool = True) -> None:
    """Shapes only: reading device values back would wait for the dispatch before. The loop
    itself stops a slot at the end of its cache row, and sampling values are checked where they
    are made (`SamplingParams.make`)."""
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"n_steps must be an integer >= 1, got {n_steps!r}")
    n = cache.n_slots
    for name in ("last_token", "done", "remaining", "key"):
        _check_shape(f"state.{name}", getattr(state, name), (n,), "one entry per cache slot:")
    for name in ("temperature", "top_k", "top_p"):
        _check_shape(f"SamplingParams.{name}", getattr(sp, name), (n,), "one value per cache slot:")
    if not (np.ndim(stop_ids) == 1 or (np.ndim(stop_ids) == 2 and np.shape(stop_ids)[0] == n)) \
            or not _is_int_array(stop_ids):
        raise ValueError(f"stop_ids must be integer ids [K] shared by all slots or [{n}, K] one row per slot, "
                         f"got {jnp.result_type(stop_ids)} of shape {tuple(np.shape(stop_ids))}")


def decode_steps(cfg: ModelConfig, params: Params, cache, state: DecodeState, sp: SamplingParams, stop_ids,
                 n_steps: int, *, greedy: bool, filters: bool = True, logprobs: bool = False, adjust=None,
                 history=None, mask=None, tuning: Tuning = TUNING):
    """The decode loop, the one every decode program runs (`decode_loop`, `greedy_decode_loop`,
    `rjax.engine.slots.decode_dispatch`): up to n_steps steps over every row of `cache` (contiguous or
    paged), stopping early when every row is done (`finished`). Each row samples by its own
    settings and random stream (`sample_rows`). Static switches leave out what no row needs:
    greedy (the argmax alone), filters (top-k / top-p), logprobs (each step's TopLogprobs),
    adjust (a LogitAdjust [B] with `history` [B, vocab] and token bitmasks `mask`: each step's
    logits adjusted and masked, the sampled tokens counted into the carried history).
    -> (tokens [B, n_steps] int32, -1 where nothing was generated; TopLogprobs or None; state;
    cache; history)."""
    B = state.last_token.shape[0]
    out0 = jnp.full((B, n_steps), -1, jnp.int32)
    k = min(MAX_TOP_LOGPROBS, cfg.vocab_size)
    lp0 = TopLogprobs(jnp.zeros((B, n_steps)), jnp.zeros((B, n_steps, k), jnp.int32),
                      jnp.zeros((B, n_steps, k))) if logprobs else None

    def cond(carry):
        i, _, _, state, _, _ = carry
        return (i < n_steps) & ~jnp.all(state.done)

    def body(carry):
        i, out, lp, state, cache, history = carry
        active = ~state.done & (cache.lengths < cache.max_len)
        logits, cache = _decode_logits(cfg, params, cache, state.last_token, active, tuning)
        z = logits if adjust is None else mask_logits(adjust_logits(logits, adjust, history, sp.temperature), mask)
        tok, keys = sample_rows(z, state.key, sp, greedy, filters)
        if adjust is not None:
            history = history.at[jnp.arange(B), tok].add(active.astype(jnp.int32))
        out = out.at[:, i].set(jnp.where(active, tok, -1))
        if logprobs:
            lp = jax.tree.map(lambda full, step: full.at[:, i].set(step), lp, top_logprobs(logits, tok))
        remaining = state.remaining - active.astype(jnp.int32)
        done = state.done | (active & finished(is_stop(tok, stop_ids), remaining, cache.lengths, cache.max_len))
        state = DecodeState(jnp.where(active, tok, state.last_token), done, remaining, keys)
        return i + 1, out, lp, state, cache, history

    _, out, lp, state, cache, history = jax.lax.while_loop(
        cond, body, (jnp.int32(0), out0, lp0, state, cache, history if adjust is not None else None))
    return out, lp, state, cache, history


_DECODE_LOOP_JIT = dict(static_argnames=("cfg", "n_steps", "tuning"), donate_argnames=("cache",),
                        compiler_options=DECODE_LOOP_COMPILER_OPTIONS)


@_checked(_check_decode_loop, **_DECODE_LOOP_JIT | dict(static_argnames=("cfg", "n_steps", "tuning", "filters")))
def decode_loop(cfg: ModelConfig, params: Params, cache: KVCache, state: DecodeState, sp: SamplingParams,
                stop_ids: jax.Array, n_steps: int, tuning: Tuning = TUNING, filters: bool = True):
    """Up to n_steps decode steps in one XLA program (`decode_steps`), stopping early when every
    slot is done: after a stop token, after its token budget, or when its cache row is full.
    `tuning`: the kernel thresholds the step's plan is made with (benchmarks try others).
    filters (static): False where no slot uses top-k or top-p, so that sampling leaves out their
    search over the vocabulary (`rjax.sample`; the same tokens). The search is about 110 small
    kernels a step; without it a temperature alone samples as fast as greedy decoding
    (docs/kernels.md, "The decode step").
    -> (tokens [B, n_steps] int32 with -1 where nothing was generated, state, cache).
    """
    out, _, state, cache, _ = decode_steps(cfg, params, cache, state, sp, stop_ids, n_steps, greedy=False,
                                           filters=filters, tuning=tuning)
    return out, state, cache


@_checked(_check_decode_loop, **_DECODE_LOOP_JIT)
def greedy_decode_loop(cfg: ModelConfig, params: Params, cache: KVCache, state: DecodeState, sp: SamplingParams,
                       stop_ids: jax.Array, n_steps: int, tuning: Tuning = TUNING):
    """`decode_loop` for slots that all decode greedily (every temperature in `sp` is 0): each
    token is the argmax of its logits, so the program holds no conditional. XLA runs a
    conditional from the host, which waits for the step before it, and a while loop holding one
    stays on the host too: one launch per step, and a call that returns only when its last step
    is done. Without it the whole loop is one CUDA graph on the device, and a call returns at
    once, so the next call is launched before this one is read back
    (docs/kernels.md, "The decode step")."""
    out, _, state, cache, _ = decode_steps(cfg, params, cache, state, sp, stop_ids, n_steps, greedy=True,
                                           tuning=tuning)
    return out, state, cache


def program_params(params: Params, dtype) -> Params:
    """The params to call a run of programs with. On the XLA path (no GPU, one device) each program
    dequantizes every layer's weights on entry, once per call: a dispatch of one decode step (a
    constrained request's), or a prefill, spends about as long on that as on the step. So a
    caller that will run many programs converts them here once, when the copy fits in half the
    host's free memory (a decode loop holds that copy anyway, XLA hoisting the conversion out of
    the loop); the programs compute the same values. Elsewhere: params as they are."""
    if jax.default_backend() == "gpu" or params.tp is not None:
        return params
    n = dense_layers_bytes(params, dtype)
    if n == 0 or n > host_available_bytes() // 2:
        return params
    return dense_layers(params, dtype)


def pad_prompts(prompts: list[list[int]], bucket: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists to one bucketed length. -> (tokens [P, T] int32, lengths [P] int32)."""
    if not len(prompts):
        raise ValueError("no prompts: at least one is needed")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"prompt {int(np.flatnonzero(lengths == 0)[0])} is empty: at least one token is needed")
    T = bucket or prompt_bucket(int(lengths.max()))
    if T < lengths.max():
        raise ValueError(f"bucket {T} is shorter than the longest prompt ({int(lengths.max())} tokens)")
    tokens = np.zeros((len(prompts), T), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


def settle(*trees) -> None:
    """Wait for the device work that produces the arrays in `trees` (those not donated since).
    A stream that stops early (Ctrl-C, a consumer that breaks off) calls this before it lets go
    of its last dispatch: a process that exits while XLA's CPU threads still run a computation
    aborts ("terminate called without an active exception"), and a caller that goes on gets
    buffers that are complete."""
    live = [x for x in jax.tree.leaves(trees) if isinstance(x, jax.Array) and not x.is_deleted()]
    if live:
        jax.block_until_ready(live)


def alive(tree) -> bool:
    """Whether `tree` is there and none of its arrays has been donated (deleted) since."""
    return tree is not None and not any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(tree))
