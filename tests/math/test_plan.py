"""The fusion plan (rjax.math.plan) and the model following it, on the CPU.

A GPU plan is built here from shapes alone (`gpu=True`), so every choice the GPU would make is
checked without one: the exact GPU program is traced (`jax.eval_shape`, Pallas kernels
included, nothing lowered) for every catalog architecture, every quant mix `rjax synth`
writes, batch rows 1..64, contiguous and paged caches, cache rows given or not; and the GPU
plan is run with the references, and with the kernels in Pallas' interpreter, against the
CPU plan's float32 logits.
"""
from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rjax
from pallas_kernels.quant_matmul import TUNING
from rjax.loading.synth import write_synthetic
from rjax.math.cache import init_cache
from rjax.math.model import forward
from rjax.math.paged_cache import init_paged_cache
from rjax.math.plan import plan_for

SHAPES = ("smollm2-135m", "llama-1b", "qwen2.5-1.5b", "gemma3-1b")
MIXES = ("q4_k", "q4_k_m", "q8_0", "q4_0", "q4_1", "f16")
# (sequences, tokens each): decode at 1..64 rows, prefill chunks
CALLS = ((1, 1), (2, 1), (5, 1), (16, 1), (64, 1), (1, 16), (4, 16))
MAX_LEN = 64


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    """Two-layer synthetic models in the layout a GPU load gives (stacked products, GPU planes)."""
    d = tmp_path_factory.mktemp("plan")
    cache = {}

    def get(shape, mix):
        if (shape, mix) not in cache:
            path = write_synthetic(d / f"{shape}-{mix}.gguf", shape, mix, seed=1, n_layers=2, vocab_size=512,
                                   tokenizer_from="builtin")
            cache[shape, mix] = rjax.load(path, progress=False, fuse=True, gpu_layout=True)
        return cache[shape, mix]
    return get


def _cache(cfg, batch, paged: bool, dtype):
    if paged:
        c = init_paged_cache(cfg, batch, batch * MAX_LEN // 16, 16, MAX_LEN, dtype)
        tables = jnp.arange(batch * MAX_LEN // 16, dtype=jnp.int32).reshape(batch, MAX_LEN // 16)
        return type(c)(c.k, c.v, tables, c.lengths)
    return init_cache(cfg, batch, MAX_LEN, dtype)


def _inputs(batch, tokens, offset=0):
    ids = (jnp.arange(batch * tokens, dtype=jnp.int32).reshape(batch, tokens) * 7 + 3) % 500
    pos = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32) + offset, (batch, tokens))
    return ids, pos


@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_program_traces_for_every_path(gpu_models, shape):
    """The GPU program of every call shape, cache kind and quant mix traces, with the logits'
    shape: no shape or type error between the fused ops (the class of a list-of-one prompt
    through a paged cache at one row, which once lost its residual)."""
    for mix in MIXES:
        model = gpu_models(shape, mix)
        cfg, params = model.config, model.params
        for batch, tokens in CALLS:
            for paged, slots in ((False, None), (False, jnp.arange(batch)), (True, jnp.arange(batch))):
                plan = plan_for(cfg, params, batch, tokens, jnp.bfloat16, paged=paged, slots=slots is not None,
                                gpu=True, implementation="pallas")
                ids, pos = _inputs(batch, tokens)
                out = jax.eval_shape(lambda p, c, t, q, s: forward(cfg, p, c, t, q, s, jnp.bfloat16, plan), params,
                                     _cache(cfg, batch, paged, jnp.bfloat16), ids, pos, slots)
                assert out[0].shape == (batch, tokens, cfg.vocab_size), (mix, batch, tokens, paged)


def test_plan_choices(gpu_models):
    """The measured choices, as the plan states them: smollm2's Q4_1 layers at one row leave the
    norms to the next product and the GLU to the down product, at five rows the products before
    the norms add and norm; llama's Q4_K layers do the add +
    norm in the int8 products and hand attention's output over in int8; batched, Q4_K goes to
    the wgmma kernel; a paged cache (the serving engine's) rotates, appends into its pages and
    attends in one kernel at one token, over any slots (a contiguous cache only over rows
    0..B-1), and leaves the norms pending as a contiguous one does; a CPU plan defers nothing."""
    sm = gpu_models("smollm2-135m", "q4_1")
    p = plan_for(sm.config, sm.params, 1, 1, jnp.bfloat16, gpu=True)
    assert p.layers[0].ffn_norm == "pending" and p.layers[0].glu == "down" and p.layers[0].out_norm == "pending"
    assert p.layers[-1].out_norm == "norm" and p.layers[0].attention == "rope_attention"
    # a verification's 5 positions: the output and down products add and norm in their kernels
    p5 = plan_for(sm.config, sm.params, 1, 5, jnp.bfloat16, gpu=True)
    assert (p5.layers[0].ffn_norm, p5.layers[0].out_norm, p5.layers[-1].out_norm, p5.counts) == \
        ("product_rows", "product_rows", "norm", True)
    assert p5.layers[0].attend == "decode" and "rope_append/decode" in str(p5)
    paged = plan_for(sm.config, sm.params, 1, 1, jnp.bfloat16, gpu=True, paged=True, slots=True)
    assert paged.layers[0].out_norm == "pending" and paged.layers[0].attention == "rope_attention"
    assert paged.layers[0].ffn_norm == "pending"
    assert plan_for(sm.config, sm.params, 1, 1, jnp.bfloat16, gpu=True, slots=True).layers[0].attention == "rope_append"
    assert plan_for(sm.config, sm.params, 1, 5, jnp.bfloat16, gpu=True, paged=True).layers[0].attention == "rope_append"
    l1 = gpu_models("llama-1b", "q4_k")
    p = plan_for(l1.config, l1.params, 1, 1, jnp.bfloat16, gpu=True)
    assert (p.first_norm, p.layers[0].ffn_norm, p.layers[0].glu) == ("norm_int8", "product", "int8")
    assert p.layers[0].attn_out_int8 and p.layers[0].o == "int8_gemv"
    p16 = plan_for(l1.config, l1.params, 16, 1, jnp.bfloat16, gpu=True)
    assert p16.layers[0].gate_up == "wgmma" and p16.layers[0].ffn_norm == "norm"
    cpu = plan_for(l1.config, l1.params, 1, 1, jnp.float32, gpu=False)
    assert {lp.ffn_norm for lp in cpu.layers} == {"norm"} and cpu.layers[0].o == "reference"
    off = plan_for(sm.config, sm.params, 1, 1, jnp.bfloat16, gpu=True,
                   tuning=TUNING.replace(pending_norm_max_m=0, gated_x_max_m=0))
    assert off.layers[0].ffn_norm == "norm" and off.layers[0].glu == "xla"
    text = str(p)
    assert "int8_gemv" in text and "rope_attention+int8" in text and text.count("\n") == 3   # header + 2 layers


def _prefill_then_decode(cfg, params, plan_kw, paged: bool, dtype):
    """Logits of a 5-token prefill and two decode steps through one slot, each call planned with
    plan_kw; paged: through a paged cache with cache rows given, as the serving engine runs."""
    run = jax.jit(forward, static_argnames=("cfg", "dtype", "plan"))
    cache = _cache(cfg, 1, paged, dtype)
    slots = jnp.arange(1) if paged else None
    outs = []
    ids, pos = _inputs(1, 5)
    for t in range(3):
        if t:
            ids, pos = jnp.asarray([[11 * t + 1]], jnp.int32), jnp.asarray([[4 + t]], jnp.int32)
        plan = plan_for(cfg, params, 1, ids.shape[1], dtype, paged=paged, slots=paged, **plan_kw)
        logits, cache = run(cfg, params, cache, ids, pos, slots, dtype=dtype, plan=plan)
        outs.append(np.asarray(logits[:, -1], np.float32))
    return np.stack(outs)


@pytest.mark.parametrize("shape,mix,implementation", [
    ("smollm2-135m", "q4_1", "interpret"), ("smollm2-135m", "q4_1", "reference"),
    ("llama-1b", "q4_k", "reference"), ("gemma3-1b", "q4_0", "reference"), ("qwen2.5-1.5b", "q8_0", "reference"),
])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_plan_runs_like_the_cpu_plan(gpu_models, shape, mix, implementation, paged):
    """The GPU plan's deferred norms, int8 hand-overs and GLUs, run with the kernels' references
    (or the kernels in the interpreter), give the CPU plan's logits up to bfloat16 activations
    and the int8 rounding of activations (about 1% of the logits' scale)."""
    model = gpu_models(shape, mix)
    cfg, params = model.config, model.params
    if implementation == "interpret" and shape != "smollm2-135m":
        pytest.skip("interpreting the wide kernels takes minutes on a CPU")
    want = _prefill_then_decode(cfg, params, dict(gpu=False), paged, jnp.float32)
    got = _prefill_then_decode(cfg, params, dict(gpu=True, implementation=implementation), paged, jnp.bfloat16)
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-2 * scale)
    # greedy tokens agree wherever the float32 top-2 margin is not a near-tie
    top2 = np.sort(want, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 4e-2 * scale
    assert (np.argmax(got, -1) == np.argmax(want, -1))[clear].all()



def _old_attention_choice(q, k, k_scale, paged: bool) -> str:
    """The kernel the attention entry picked for these arrays on a GPU backend before the plan
    named it (its rule then, written out here as the record of that behaviour)."""
    from pallas_kernels.attention import takes_decode
    from pallas_kernels.attention.prefill_mgpu import supports

    if takes_decode(q.shape[1], q.shape[2], k.shape[1], q.shape[3]):
        return "decode"
    if not paged and k_scale is None and supports(q, k):
        return "prefill_mgpu"
    return "prefill"


# Decode at 1..64 rows, 16 positions (the decode kernel or the prefill by the heads), prefill
# chunks, and past the append kernel's 256 rows.
KERNEL_CALLS = ((1, 1), (2, 1), (64, 1), (1, 16), (1, 32), (2, 160))


@pytest.mark.parametrize("shape", SHAPES)
def test_plan_names_the_kernels_the_entry_points_picked(gpu_models, monkeypatch, shape):
    """For every call shape and cache (contiguous with rows given or not, paged; 64 and 256
    positions; bf16 and int8), the GPU plan names the kernels that the attention and append
    entry points picked from their arrays on a GPU before the plan chose them, and the caches
    hand the plan's choices to the entry points (traced, each kernel's reference standing in)."""
    import pallas_kernels.attention as attention
    import pallas_kernels.kv_append as kv_append
    import rjax.math.cache
    import rjax.math.paged_cache

    seen = []  # (entry, what the plan passed, what the old rule picked)

    def spy(name, fn, paged=False):
        def run(*args, **kw):
            if name == "attend":
                old = _old_attention_choice(args[0], args[1], kw.get("k_scale"), paged)
                seen.append((name, (str(kw["kernel"]), kw["implementation"]), (old, "pallas")))
                kw["kernel"] = None
            elif name == "append":
                rows = args[0].shape[1] * args[0].shape[2]
                seen.append((name, kw["implementation"], "pallas" if rows <= kv_append.MAX_ROWS else "reference"))
            else:
                seen.append((name, kw["implementation"], "pallas"))
            return fn(*args, **{**kw, "implementation": "reference"})
        return run

    monkeypatch.setattr(rjax.math.cache, "attention", spy("attend", attention.attention))
    monkeypatch.setattr(rjax.math.paged_cache, "paged_attention", spy("attend", attention.paged_attention, paged=True))
    monkeypatch.setattr(rjax.math.cache, "rope_attention", spy("rope_attention", attention.rope_attention))
    monkeypatch.setattr(rjax.math.paged_cache, "paged_rope_attention",
                        spy("rope_attention", attention.paged_rope_attention))
    monkeypatch.setattr(rjax.math.cache, "rope_append", spy("append", kv_append.rope_append))
    monkeypatch.setattr(rjax.math.paged_cache, "rope_append", spy("append", kv_append.rope_append))
    model = gpu_models(shape, "q8_0")
    cfg = model.config
    params = dataclasses.replace(model.params, layers=model.params.layers[:1])  # every layer plans alike
    reached = set()
    for batch, tokens in KERNEL_CALLS:
        ids, pos = _inputs(batch, tokens)
        for (max_len, kv_dtype), (paged, slots) in itertools.product(
                ((64, "bf16"), (256, "bf16"), (256, "int8")),
                ((False, None), (False, jnp.arange(batch)), (True, jnp.arange(batch)))):
            if tokens > max_len:
                continue
            if paged:
                tables = jnp.arange(batch * max_len // 16, dtype=jnp.int32).reshape(batch, max_len // 16)
                cache = init_paged_cache(cfg, batch, batch * max_len // 16, 16, max_len, jnp.bfloat16,
                                         kv_dtype=kv_dtype)
                cache = rjax.math.paged_cache.set_block_tables(cache, jnp.arange(batch), tables)
            else:
                cache = init_cache(cfg, batch, max_len, jnp.bfloat16, kv_dtype=kv_dtype)
            plan = plan_for(cfg, params, batch, tokens, jnp.bfloat16, paged=paged, slots=slots is not None, gpu=True,
                            cache_len=cache.max_len, cache_dtype=cache.storage_dtype)
            seen.clear()
            jax.eval_shape(lambda p, c, t, q, s: forward(cfg, p, c, t, q, s, jnp.bfloat16, plan), params, cache,
                           ids, pos, slots)
            where = (batch, tokens, max_len, kv_dtype, paged, slots is not None)
            assert [e[0] for e in seen].count("attend") == (plan.layers[0].attend is not None), where
            assert [(name, got) for name, got, _ in seen] == [(name, want) for name, _, want in seen], where
            reached |= {f"{name}:{got}" for name, got, _ in seen}
    # every kernel of the rules was reached (the Mosaic prefill over the 256-position caches)
    assert {"attend:('decode', 'pallas')", "attend:('prefill', 'pallas')", "attend:('prefill_mgpu', 'pallas')",
            "rope_attention:pallas", "append:pallas", "append:reference"} <= reached, reached
