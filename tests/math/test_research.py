"""The research API: `rjax.forward` from tokens or input embeddings, gradients through it (checked
against finite differences), quantized weights kept out of differentiation, `jax.vmap` over
prompts, and the default model's logits from embeddings against transformers."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rjax
from rjax.math.ops import rms_norm

TOKENS = np.array([[1, 5, 9, 200, 7, 3], [4, 4, 8, 2, 0, 0]], np.int32)
LENGTHS = np.array([6, 4], np.int32)


@pytest.fixture(scope="module")
def by_tokens(tiny):
    cfg, params = tiny
    return rjax.forward(cfg, params, TOKENS, lengths=LENGTHS, residuals=True)


def test_forward_from_embeddings_equals_forward_from_tokens(tiny, by_tokens):
    cfg, params = tiny
    e = rjax.embed(cfg, params, jnp.asarray(TOKENS))
    out = rjax.forward(cfg, params, embeddings=e, lengths=LENGTHS, residuals=True)
    B, T = TOKENS.shape
    assert by_tokens.logits.shape == (B, T, cfg.vocab_size) and by_tokens.hidden.shape == (B, T, cfg.d_model)
    assert by_tokens.residuals.shape == (cfg.n_layers + 1, B, T, cfg.d_model)
    for b, n in enumerate(LENGTHS):  # padding positions are meaningless
        for name in ("logits", "hidden", "residuals"):
            got, want = getattr(out, name)[..., b, :n, :], getattr(by_tokens, name)[..., b, :n, :]
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    np.testing.assert_array_equal(np.asarray(by_tokens.residuals[0]), np.asarray(e))
    # The hidden states are the last residual stream, final-normed; the logits are the LM head on them.
    want = rms_norm(by_tokens.residuals[-1], params.final_norm, cfg.rms_eps)
    np.testing.assert_allclose(np.asarray(by_tokens.hidden), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_forward_equals_the_engines_prefill(tiny, by_tokens):
    cfg, params = tiny
    cache = rjax.init_cache(cfg, n_slots=len(TOKENS), max_len=16)
    last, _ = rjax.prefill(cfg, params, cache, jnp.asarray(TOKENS), jnp.asarray(LENGTHS))
    got = np.asarray(by_tokens.logits)[np.arange(len(TOKENS)), LENGTHS - 1]
    np.testing.assert_allclose(got, np.asarray(last), rtol=0, atol=1e-4 * float(np.abs(got).max()))


def test_vmap_over_prompts_equals_the_batch(tiny, by_tokens):
    cfg, params = tiny
    one = jax.jit(jax.vmap(lambda params, t, n: rjax.forward(cfg, params, t[None], lengths=n[None]).logits[0],
                           in_axes=(None, 0, 0)))
    got = np.asarray(one(params, jnp.asarray(TOKENS), jnp.asarray(LENGTHS)))
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(got[b, :n], np.asarray(by_tokens.logits[b, :n]), rtol=0, atol=1e-5)


def _directional_check(loss, args, grads, eps=1e-3):
    """Each gradient against the central difference of `loss` along the gradient's own direction."""
    for i, g in enumerate(grads):
        norm = jnp.sqrt(sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in jax.tree.leaves(g)))
        assert float(norm) > 0, f"argument {i}: zero gradient"
        v = jax.tree.map(lambda x: x / norm, g)
        shifted = [[a if j != i else jax.tree.map(lambda x, d: x + s * eps * d, a, v) for j, a in enumerate(args)]
                   for s in (1, -1)]
        fd = (float(loss(*shifted[0])) - float(loss(*shifted[1]))) / (2 * eps)
        np.testing.assert_allclose(fd, float(norm), rtol=1e-2, err_msg=f"argument {i}")


def test_gradients_wrt_embeddings_and_float_params_match_finite_differences(tiny):
    cfg, params = tiny
    trainable, frozen = rjax.split_params(params)
    e = rjax.embed(cfg, params, jnp.asarray(TOKENS[:1]))

    @jax.jit
    def loss(e, trainable, frozen):
        logits = rjax.forward(cfg, rjax.merge_params(trainable, frozen), embeddings=e).logits
        return jax.nn.log_softmax(logits[0, -1])[42] + jax.nn.log_softmax(logits[0, 2])[7]

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(e, trainable, frozen)
    assert grads[0].shape == e.shape
    assert jax.tree.structure(grads[1]) == jax.tree.structure(trainable)
    _directional_check(lambda e, trainable: loss(e, trainable, frozen), (e, trainable), grads)


def test_split_params_keeps_quantized_weights_frozen(tiny, tmp_path):
    cfg, params = tiny
    trainable, frozen = rjax.split_params(params)
    names = {"embed", "final_norm"} | {f"layers.{i}.{n}" for i in range(cfg.n_layers) for n in ("attn_norm", "ffn_norm")}
    # The tiny model's matrices and embedding are Q8_0: only the norms are float.
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(trainable))
    assert len(jax.tree.leaves(trainable)) == len(names) - 1
    merged = rjax.merge_params(trainable, frozen)
    assert jax.tree.structure(merged) == jax.tree.structure(params)
    assert all(a is b for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(params)))
    only_norms, _ = rjax.split_params(params, lambda name: name.endswith("attn_norm"))
    assert len(jax.tree.leaves(only_norms)) == cfg.n_layers

    with pytest.raises(rjax.NotDifferentiableError) as e:
        rjax.split_params(params, lambda name: name.startswith("layers.1.") or name == "embed")
    message = str(e.value)
    for name in ("embed (Q8_0)", "layers.1.wq (Q8_0)", "layers.1.w_down (Q8_0)"):
        assert name in message
    assert "layers.0." not in message and "norm" not in message

    # A float model's matrices are trainable.
    from rjax.loading.loaders.gguf import load_gguf
    from rjax.loading.synth import write_synthetic

    path = write_synthetic(tmp_path / "f16.gguf", "smollm2-135m", "f16", seed=1, n_layers=1, vocab_size=512,
                           tokenizer_from="builtin")
    _, f16 = load_gguf(path, progress=False)[:2]
    trainable, frozen = rjax.split_params(f16)
    assert trainable.layers[0].wq is not None and trainable.embed is not None
    assert jax.tree.leaves(frozen) == []


def test_forward_rejects_bad_inputs(tiny):
    cfg, params = tiny
    e = jnp.zeros((1, 3, cfg.d_model))
    with pytest.raises(ValueError, match="exactly one"):
        rjax.forward(cfg, params, TOKENS, embeddings=e)
    with pytest.raises(ValueError, match="exactly one"):
        rjax.forward(cfg, params)
    with pytest.raises(ValueError, match=rf"embeddings must be \[batch, tokens, {cfg.d_model}\]"):
        rjax.forward(cfg, params, embeddings=e[..., :5])
    with pytest.raises(ValueError, match="tokens must be integer ids"):
        rjax.forward(cfg, params, np.zeros((3,), np.int32))


@pytest.mark.oracle
@pytest.mark.slow
def test_default_model_from_embeddings_matches_transformers(smollm2_path, smollm2):
    """The oracle's logits at every position (the same request as test_oracle's, so its cached
    answer is shared). The gradients are checked on the tiny model above: the same code, and a
    backward pass through the default model's 30 layers costs about a minute to compile here."""
    from tests.oracle.client import oracle_logits, oracle_tokenize

    prompt = oracle_tokenize(smollm2_path, ["The capital of France is", " Paris"])["ids_with_special"][:1]
    (ref,) = oracle_logits(smollm2_path, prompt, decode_steps=4, all_positions=True, greedy_tokens=8)
    cfg, params = smollm2.config, smollm2.params
    out = rjax.forward(cfg, params, embeddings=rjax.embed(cfg, params, jnp.asarray(prompt, jnp.int32)))
    want = ref["all_logits"]
    np.testing.assert_allclose(np.asarray(out.logits[0]), want, rtol=0, atol=1e-3 * float(np.abs(want).max()))
