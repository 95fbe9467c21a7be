"""Jitted prefill and decode: pure functions of (static config, params, KV cache, inputs).

The cache is donated to every call, so XLA updates it in place, and a call returns the new
cache. Prompts are padded to a small set of length buckets so a new prompt length reuses a
compiled program; `decode_loop` runs many decode steps (sampling and stop conditions
included) inside one XLA program, which is what CUDA-graph replay is for in other engines.
Only token ids leave the device.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rjax.cache import KVCache
from rjax.config import ModelConfig
from rjax.model import Params, hidden_states, logits_from_hidden
from rjax.sampling import SamplingParams, sample

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def prompt_bucket(n: int) -> int:
    """The padded length a prompt of n tokens is compiled for."""
    for b in PROMPT_BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"prompt of {n} tokens is longer than the largest bucket {PROMPT_BUCKETS[-1]}")


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


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill(cfg: ModelConfig, params: Params, cache: KVCache, tokens: jax.Array, lengths: jax.Array,
            slots: jax.Array | None = None):
    """Run P prompts (tokens [P, T] right-padded, true lengths [P]) into cache rows `slots` [P]
    (None: rows 0..P-1), appending after what those rows already hold.
    -> (logits at each prompt's last token [P, vocab] float32, cache)."""
    return _prefill_logits(cfg, params, cache, tokens, lengths, slots)


def _decode_logits(cfg, params, cache: KVCache, tokens, active):
    pos = jnp.where(active, cache.lengths, -1)[:, None]
    h, cache = hidden_states(cfg, params, cache, tokens[:, None], pos, None, cache.dtype)
    return logits_from_hidden(params, h[:, 0]), cache.advance(None, active.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode_step(cfg: ModelConfig, params: Params, cache: KVCache, tokens: jax.Array, active: jax.Array | None = None):
    """One token for every slot: tokens [n_slots] are appended at each slot's length
    (inactive slots are left untouched). -> (logits [n_slots, vocab] float32, cache)."""
    if active is None:
        active = jnp.ones(tokens.shape, bool)
    return _decode_logits(cfg, params, cache, tokens, active)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill_and_sample(cfg, params, cache, tokens, lengths, slots, key, sp: SamplingParams):
    """prefill, then sample the first generated token on the device. -> (tokens [P] int32, cache)."""
    logits, cache = _prefill_logits(cfg, params, cache, tokens, lengths, slots)
    return sample(logits, key, sp), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Per-slot generation state carried from one decode dispatch to the next."""

    last_token: jax.Array  # [B] int32: sampled but not yet in the cache
    done: jax.Array        # [B] bool
    remaining: jax.Array   # [B] int32: tokens each slot may still generate
    key: jax.Array


def _is_stop(tokens, stop_ids):
    """stop_ids: [K] shared by every slot, or [B, K] one row per slot (pad rows with -1)."""
    stop = stop_ids if stop_ids.ndim == 2 else stop_ids[None, :]
    return jnp.any(tokens[:, None] == stop, axis=-1)


def initial_state(first_tokens, max_new_tokens, stop_ids, key, cache: KVCache, slots=None) -> DecodeState:
    """State after the first token came out of prefill (it counts as one generated token)."""
    first_tokens = jnp.asarray(first_tokens, jnp.int32)
    remaining = jnp.asarray(max_new_tokens, jnp.int32) - 1
    lengths = _rows(cache, slots)
    done = _is_stop(first_tokens, stop_ids) | (remaining <= 0) | (lengths >= cache.max_len)
    return DecodeState(first_tokens, done, jnp.broadcast_to(remaining, first_tokens.shape), key)


# XLA runs a while loop's condition on the host unless the loop is in a command buffer: after
# every decode step the GPU drains and the host reads the predicate back before it launches the
# next step. With WHILE and CONDITIONAL among the command-buffer types the whole loop is one CUDA
# graph whose conditional nodes test the predicate on the device. The option replaces XLA's list,
# so the list repeats the default types. H100, batch 1, A/B against the default (session 13):
# llama-1b Q4_K 1,339 against 1,170 tokens/s, smollm2-135m 1,200 against 1,137. A CPU backend
# ignores it.
DECODE_LOOP_COMPILER_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL",
    "xla_gpu_graph_min_graph_size": 1,
}


@functools.partial(jax.jit, static_argnames=("cfg", "n_steps"), donate_argnames=("cache",),
                   compiler_options=DECODE_LOOP_COMPILER_OPTIONS)
def decode_loop(cfg: ModelConfig, params: Params, cache: KVCache, state: DecodeState, sp: SamplingParams,
                stop_ids: jax.Array, n_steps: int):
    """Up to n_steps decode steps in one XLA program, stopping early when every slot is done.

    A slot is done after a stop token, after its token budget, or when the cache is full.
    -> (tokens [B, n_steps] int32 with -1 where nothing was generated, state, cache).
    """
    B = state.last_token.shape[0]
    out0 = jnp.full((B, n_steps), -1, jnp.int32)

    def cond(carry):
        i, _, state, _ = carry
        return (i < n_steps) & ~jnp.all(state.done)

    def body(carry):
        i, out, state, cache = carry
        active = ~state.done & (cache.lengths < cache.max_len)
        logits, cache = _decode_logits(cfg, params, cache, state.last_token, active)
        key, sub = jax.random.split(state.key)
        tok = sample(logits, sub, sp)
        out = out.at[:, i].set(jnp.where(active, tok, -1))
        remaining = state.remaining - active.astype(jnp.int32)
        done = state.done | (active & (_is_stop(tok, stop_ids) | (remaining <= 0) | (cache.lengths >= cache.max_len)))
        state = DecodeState(jnp.where(active, tok, state.last_token), done, remaining, key)
        return i + 1, out, state, cache

    _, out, state, cache = jax.lax.while_loop(cond, body, (jnp.int32(0), out0, state, cache))
    return out, state, cache


def pad_prompts(prompts: list[list[int]], bucket: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists to one bucketed length. -> (tokens [P, T] int32, lengths [P] int32)."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise ValueError("empty prompt: at least one token is needed")
    T = bucket or prompt_bucket(int(lengths.max()))
    tokens = np.zeros((len(prompts), T), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths
