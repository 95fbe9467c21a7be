"""The default model (llama architecture, Q4_1/Q8_0 GGUF) against transformers on the same file.

Prompts are tokenized by the oracle so that only the model is compared here. All prompts run as
one batch in one cache, with different lengths, so padding and per-slot positions are exercised.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from rjax.engine import steps
from rjax.loading.loaders.gguf import load_gguf
from rjax.math.cache import init_cache
from rjax.math.sampling import SamplingParams
from tests.oracle.client import oracle_logits, oracle_tokenize

LONG = " ".join(f"Item {i}: the {w} fox jumps over {i * 7} lazy dogs." for i, w in
                enumerate(["quick", "brown", "red", "sly", "old", "young", "grey", "tiny", "giant", "swift"] * 3))
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "Translate to German: The weather is nice today.",
    LONG,
]
DECODE_STEPS = 16
GREEDY = 32


def _close(ours, ref, what):
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    err = float(np.max(np.abs(ours - ref)))
    bound = 1e-3 * float(np.max(np.abs(ref)))
    assert err <= bound, f"{what}: max|Δ| {err:.3g} > 1e-3·max|logit| = {bound:.3g}"


@pytest.fixture(scope="module")
def case(smollm2_path):
    ids = oracle_tokenize(smollm2_path, PROMPTS)["ids_with_special"]
    assert len(ids[-1]) >= 200, len(ids[-1])
    ref = oracle_logits(smollm2_path, ids, DECODE_STEPS, greedy_tokens=GREEDY)
    cfg, params, _ = load_gguf(smollm2_path, progress=False)
    return ids, ref, cfg, params


def test_prefill_and_teacher_forced_decode_match_transformers(case):
    ids, ref, cfg, params = case
    cache = init_cache(cfg, len(ids), 512)
    tokens, lengths = steps.pad_prompts(ids)
    logits, cache = steps.prefill(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths))
    for i, r in enumerate(ref):
        _close(logits[i], r["last_logits"], f"prompt {i} after prefill")
    for step in range(DECODE_STEPS):
        feed = jnp.asarray([int(r["step_tokens"][step]) for r in ref], jnp.int32)
        logits, cache = steps.decode_step(cfg, params, cache, feed)
        for i, r in enumerate(ref):
            _close(logits[i], r["step_logits"][step], f"prompt {i} decode step {step}")
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + DECODE_STEPS)


def test_greedy_continuations_identical(case):
    ids, ref, cfg, params = case
    B = len(ids)
    cache = init_cache(cfg, B, 1024)
    tokens, lengths = steps.pad_prompts(ids)
    sp = SamplingParams.make(B)
    import jax

    key = jax.random.key(0)
    first, cache = steps.prefill_and_sample(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths), None, key, sp)
    stop = jnp.asarray([-1], jnp.int32)  # no stop token: compare all 32 tokens
    state = steps.initial_state(first, jnp.full((B,), GREEDY, jnp.int32), stop, key, cache)
    out, state, cache = steps.decode_loop(cfg, params, cache, state, sp, stop, GREEDY - 1)
    got = np.concatenate([np.asarray(first)[:, None], np.asarray(out)], axis=1)
    for i, r in enumerate(ref):
        np.testing.assert_array_equal(got[i], r["greedy"][:GREEDY], err_msg=f"prompt {i}")
    assert bool(np.all(np.asarray(state.done)))
