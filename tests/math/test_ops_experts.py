"""The routed mixture of experts (rjax.math.ops.experts) against its definition (ops.experts_reference:
every expert on every row, the unchosen ones weighted 0), float32: dense experts as a Hugging Face
checkpoint holds them and packed ones (Q8_0, Q4_K) as a GGUF does, in both forms the plan picks
(each row's experts gathered; rows grouped by expert), renormalized top k (Mixtral, Qwen3-MoE with
norm_topk_prob) or not. And the routed forms read only the chosen experts: weights of an expert
no row chooses may be NaN. Then whole tiny mixtures (Mixtral, Qwen3-MoE) loaded from GGUF with
their experts packed: prefill and decode logits of the routed model equal the reference's."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from gguf_blocks.qtensor import QTensor
from pallas_kernels.quant_matmul.testing import random_qtensor
from rjax.cli.info import model_info
from rjax.engine.memory import tree_bytes
from rjax.loading.loaders.gguf import load_gguf, stack_experts
from rjax.math import ops
from rjax.math.cache import init_cache
from rjax.math.model import forward, plan_of
from rjax.math.plan import experts_form

E, K, D, F = 8, 2, 256, 256


def _weights(qtype, seed):
    """gate, up (E, F, D) and down (E, D, F): dense float32, or packed with a leading expert axis."""
    rng = np.random.default_rng(seed)
    if qtype is None:
        return [jnp.asarray(rng.normal(0, 0.1, (E, *s)), jnp.float32) for s in ((F, D), (F, D), (D, F))]
    return [stack_experts(jax.tree.map(jnp.asarray, QTensor(random_qtensor(qtype, E * o, i, seed + j).planes, qtype,
                                                            (E, o, i))))
            for j, (o, i) in enumerate(((F, D), (F, D), (D, F)))]


@pytest.mark.parametrize("qtype, normalize", [(None, True), (None, False), (QType.Q8_0, True), (QType.Q4_K, False)],
                         ids=["dense-renormalized", "dense-softmax", "q8_0-renormalized", "q4_k-softmax"])
def test_routed_experts_equal_the_reference(qtype, normalize):
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(0, 1, (3, 5, D)), jnp.float32)
    router = jnp.asarray(rng.normal(0, 0.5, (E, D)), jnp.float32)
    w = _weights(qtype, 2)
    kw = dict(k=K, normalize=normalize, act="silu")
    ref = np.asarray(jax.jit(lambda h: ops.experts_reference(h, router, *w, **kw))(h))
    scale = np.abs(ref).max()
    for how in ("gather", "grouped"):
        out = np.asarray(jax.jit(lambda h: ops.experts(how, h, router, *w, **kw))(h))
        assert out.shape == ref.shape
        np.testing.assert_allclose(out, ref, atol=2e-5 * scale, rtol=0, err_msg=how)


def test_routed_experts_read_only_the_chosen():
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.normal(0, 1, (4, D)), jnp.float32)
    router = jnp.asarray(rng.normal(0, 0.5, (E, D)), jnp.float32).at[5].set(-h.sum(0) * 100)  # never chosen
    w = _weights(None, 4)
    kw = dict(k=K, normalize=True, act="silu")
    ref = np.asarray(jax.jit(lambda h: ops.experts_reference(h, router, *w, **kw))(h))
    poisoned = [x.at[5].set(jnp.nan) for x in w]
    assert not (np.asarray(ops.route(h, router, K, True)[1]) == 5).any()
    for how in ("gather", "grouped"):
        out = jax.jit(lambda h: ops.experts(how, h, router, *poisoned, **kw))(h)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=0,
                                   atol=2e-5 * np.abs(ref).max(), err_msg=how)


def test_an_expert_most_rows_choose_spans_several_tiles():
    rng = np.random.default_rng(5)
    common = rng.normal(0, 1, D)
    h = jnp.asarray(rng.normal(0, 1, (96, D)) + common, jnp.float32)
    router = jnp.asarray(rng.normal(0, 0.1, (E, D)), jnp.float32).at[2].add(jnp.asarray(common / 4, jnp.float32))
    w = _weights(None, 6)
    kw = dict(k=K, normalize=False, act="gelu_tanh")
    assert (np.asarray(ops.route(h, router, K, False)[1]) == 2).sum() > 64  # tiles of 32 here
    ref = np.asarray(jax.jit(lambda h: ops.experts_reference(h, router, *w, **kw))(h))
    out = jax.jit(lambda h: ops.experts("grouped", h, router, *w, **kw))(h)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=0,
                               atol=2e-5 * np.abs(ref).max())


def test_the_plan_gathers_while_that_reads_fewer_experts():
    assert experts_form(1, 2, 8) == "gather" and experts_form(4, 2, 8) == "grouped"      # Mixtral
    assert experts_form(15, 8, 128) == "gather" and experts_form(16, 8, 128) == "grouped"  # Qwen3-30B-A3B


def _logits(cfg, params, tokens, pos, reference: bool):
    cache = init_cache(cfg, tokens.shape[0], 64)
    plan = plan_of(cfg, params, cache, tokens, None, jnp.float32)
    if reference:
        plan = dataclasses.replace(plan, layers=tuple(dataclasses.replace(lp, gate_up="reference", down="reference")
                                                      for lp in plan.layers))
    run = jax.jit(lambda params, cache, tokens, pos: forward(cfg, params, cache, tokens, pos, plan=plan)[0])
    return np.asarray(run(params, cache, tokens, pos)), plan


def test_packed_mixture_from_gguf_equals_the_reference(tiny_moe_path):
    cfg, params, reader = load_gguf(tiny_moe_path, progress=False)
    p = params.layers[0]
    E, F, d = cfg.n_experts, cfg.expert_d_ff, cfg.d_model
    assert [w.shape for w in (p.w_gate_exps, p.w_up_exps, p.w_down_exps)] == [(E, F, d), (E, F, d), (E, d, F)]
    assert all(isinstance(w, QTensor) and jax.tree.leaves(w.planes)[0].shape[:2] == w.shape[:2]
               for w in (p.w_gate_exps, p.w_up_exps, p.w_down_exps))
    file_bytes = {t.name: int(t.n_bytes) for t in reader.tensors}
    assert p.w_down_exps.nbytes == file_bytes["blk.0.ffn_down_exps.weight"]  # packed, not dequantized
    # what `rjax info` and the memory plan count for the weights is what the load holds
    info = model_info(str(tiny_moe_path))
    assert info["memory"]["params_bytes"] == tree_bytes(params)
    assert info["architecture"] == reader.fields["general.architecture"].contents()  # qwen3moe, not qwen3
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 9)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(9), (3, 9)).at[1, 6:].set(-1)
    for tokens, pos in [(prompts, pos), (prompts[:1, :1], pos[:1, :1])]:  # prefill: grouped; one row: gathered
        out, plan = _logits(cfg, params, tokens, pos, reference=False)
        ref, _ = _logits(cfg, params, tokens, pos, reference=True)
        assert plan.layers[0].gate_up == ("gather" if tokens.size == 1 else "grouped")
        valid = np.asarray(pos) >= 0
        err = np.abs(out - ref)[valid].max() / np.abs(ref[valid]).max()
        assert err < 1e-5, (plan.layers[0].gate_up, err)
