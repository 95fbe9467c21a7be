"""The functional core on a small synthetic model: cache writes, slots, buckets, decode loop, errors.

Numbers are compared between independent routes through the engine (one prefill against a
prefill plus decode steps, one slot against a batch); the model against transformers lives in
tests/math/test_model_llama.py.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter

import rjax
from rjax.engine import steps as engine
from rjax.loading.loaders.gguf import ModelFileError, load_gguf
from rjax.math.cache import init_cache
from rjax.runtime.generation import PromptTooLongError, check_prompt_lengths
from gguf_blocks.formats import TensorFormatError
from gguf_blocks.qtensor import QTensor
from rjax.math.plan import TUNING
from rjax.math.sampling import SamplingParams


def _prompts(seed, lengths, vocab):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, vocab, n)) for n in lengths]


def test_prefill_then_decode_equals_one_longer_prefill(tiny):
    cfg, params = tiny
    ids = _prompts(0, [12], cfg.vocab_size)[0]
    full_cache = init_cache(cfg, 1, 64)
    t, l = engine.pad_prompts([ids])
    full, _ = engine.prefill(cfg, params, full_cache, jnp.asarray(t), jnp.asarray(l))

    cache = init_cache(cfg, 1, 64)
    t, l = engine.pad_prompts([ids[:8]])
    logits, cache = engine.prefill(cfg, params, cache, jnp.asarray(t), jnp.asarray(l))
    for tok in ids[8:]:
        logits, cache = engine.decode_step(cfg, params, cache, jnp.asarray([tok], jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full), rtol=0, atol=1e-4 * float(jnp.abs(full).max()))
    assert int(cache.lengths[0]) == 12


def test_batched_prefill_equals_each_prompt_alone(tiny):
    cfg, params = tiny
    prompts = _prompts(1, [3, 17, 9], cfg.vocab_size)
    # Full float32 products: on a GPU XLA's float32 dot defaults to tf32, whose rounding (about
    # 1e-3 of the logits) differs between the batched and the single program.
    with jax.default_matmul_precision("highest"):
        cache = init_cache(cfg, 3, 64)
        t, l = engine.pad_prompts(prompts)
        batched, cache = engine.prefill(cfg, params, cache, jnp.asarray(t), jnp.asarray(l))
        np.testing.assert_array_equal(np.asarray(cache.lengths), [3, 17, 9])
        for i, p in enumerate(prompts):
            alone, _ = engine.prefill(cfg, params, init_cache(cfg, 1, 64), *map(jnp.asarray, engine.pad_prompts([p])))
            np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(alone[0]),
                                       atol=1e-4 * float(jnp.abs(alone).max()))


def test_prefill_into_one_slot_leaves_the_others_untouched(tiny):
    cfg, params = tiny
    cache = init_cache(cfg, 3, 32)
    cache = dataclasses.replace(cache, k=jax.tree.map(lambda a: a + 7.0, cache.k),
                                v=jax.tree.map(lambda a: a - 3.0, cache.v))  # recognisable contents
    before_k, before_v = np.asarray(cache.k), np.asarray(cache.v)
    t, l = engine.pad_prompts(_prompts(2, [5], cfg.vocab_size))
    _, cache = engine.prefill(cfg, params, cache, jnp.asarray(t), jnp.asarray(l), jnp.asarray([1], jnp.int32))
    k, v = np.asarray(cache.k), np.asarray(cache.v)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [0, 5, 0])
    for s in (0, 2):
        np.testing.assert_array_equal(k[:, s], before_k[:, s])
        np.testing.assert_array_equal(v[:, s], before_v[:, s])
    assert not np.array_equal(k[:, 1, :, :5], before_k[:, 1, :, :5])
    np.testing.assert_array_equal(k[:, 1, :, 5:], before_k[:, 1, :, 5:])  # nothing past the prompt
    # An inactive slot in decode is not written and does not advance.
    _, cache = engine.decode_step(cfg, params, cache, jnp.asarray([1, 2, 3], jnp.int32),
                                  jnp.asarray([False, True, False]))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [0, 6, 0])
    np.testing.assert_array_equal(np.asarray(cache.k)[:, 0], before_k[:, 0])


def test_prompt_lengths_within_a_bucket_share_one_compilation(tiny):
    cfg, params = tiny
    sp = SamplingParams.make(1)
    key = jax.random.key(0)
    fn = engine.prefill_and_sample

    def run(n):
        t, l = engine.pad_prompts(_prompts(n, [n], cfg.vocab_size))
        cache = init_cache(cfg, 1, 64)
        fn(cfg, params, cache, jnp.asarray(t), jnp.asarray(l), None, key, sp)[0].block_until_ready()

    run(5)
    before = fn.compiled_count()
    for n in (6, 9, 15, 16):
        run(n)
    assert fn.compiled_count() == before, "a prompt length inside the 16-token bucket recompiled"
    run(17)
    assert fn.compiled_count() == before + 1
    # Other sampling parameters are arrays, not static arguments: no recompilation either.
    t, l = engine.pad_prompts(_prompts(3, [7], cfg.vocab_size))
    fn(cfg, params, init_cache(cfg, 1, 64), jnp.asarray(t), jnp.asarray(l), None, key,
       SamplingParams.make(1, temperature=0.8, top_k=5, top_p=0.9))[0].block_until_ready()
    assert fn.compiled_count() == before + 1


LOOPS = [pytest.param(engine.decode_loop, id="decode_loop"), pytest.param(engine.greedy_decode_loop, id="greedy")]


@pytest.mark.parametrize("loop", LOOPS)
def test_decode_loop_greedy_equals_step_by_step_and_stops_at_stop_token(tiny, loop):
    cfg, params = tiny
    prompts = _prompts(4, [6, 11], cfg.vocab_size)
    sp = SamplingParams.make(2)
    key = jax.random.key(1)

    # Step by step with decode_step + argmax.
    cache = init_cache(cfg, 2, 64)
    t, l = engine.pad_prompts(prompts)
    logits, cache = engine.prefill(cfg, params, cache, jnp.asarray(t), jnp.asarray(l))
    expected = [np.asarray(jnp.argmax(logits, -1))]
    for _ in range(9):
        logits, cache = engine.decode_step(cfg, params, cache, jnp.asarray(expected[-1], jnp.int32))
        expected.append(np.asarray(jnp.argmax(logits, -1)))
    expected = np.stack(expected, 1)  # [2, 10]

    cache = init_cache(cfg, 2, 64)
    first, cache = engine.prefill_and_sample(cfg, params, cache, jnp.asarray(t), jnp.asarray(l), None, key, sp)
    no_stop = jnp.asarray([-1], jnp.int32)
    state = engine.initial_state(first, jnp.asarray([10, 10]), no_stop, key, cache)
    out, state, cache = loop(cfg, params, cache, state, sp, no_stop, 4)
    out2, state, cache = loop(cfg, params, cache, state, sp, no_stop, 8)
    got = np.concatenate([np.asarray(first)[:, None], np.asarray(out), np.asarray(out2)], 1)
    np.testing.assert_array_equal(got[:, :10], expected)
    assert (got[:, 10:] == -1).all() and bool(np.asarray(state.done).all())  # the 10-token budget

    # With sequence 0's 4th token as a stop token, sequence 0 stops right after emitting it.
    stop_tok = int(expected[0, 3])
    stop = jnp.asarray([stop_tok], jnp.int32)
    cache = init_cache(cfg, 2, 64)
    first, cache = engine.prefill_and_sample(cfg, params, cache, jnp.asarray(t), jnp.asarray(l), None, key, sp)
    state = engine.initial_state(first, jnp.asarray([10, 10]), stop, key, cache)
    out, state, cache = loop(cfg, params, cache, state, sp, stop, 9)
    row0 = np.asarray(out)[0]
    first_stop = list(expected[0]).index(stop_tok)
    np.testing.assert_array_equal(row0[:first_stop], expected[0, 1:first_stop + 1])
    assert (row0[first_stop:] == -1).all()


def test_greedy_decode_loop_holds_no_conditional(tiny):
    """Neither loop holds a conditional (XLA would run one from the host each step, and keep the
    loop there) or a sort (on a GPU XLA hands a one-row sort to cub, a custom call that no CUDA
    graph captures, which would keep the loop there too); greedy_decode_loop also leaves out
    sampling."""
    cfg, params = tiny
    cache, sp, stop = init_cache(cfg, 1, 64), SamplingParams.make(1), jnp.asarray([-1], jnp.int32)
    state = engine.initial_state(jnp.zeros((1,), jnp.int32), jnp.asarray([8]), stop, jax.random.key(0), cache)
    text = {f: f.trace(cfg, params, cache, state, sp, stop, 4).lower().as_text()
            for f in (engine.decode_loop, engine.greedy_decode_loop)}
    assert "stablehlo.case" not in text[engine.decode_loop] and "stablehlo.sort" not in text[engine.decode_loop]
    assert "stablehlo.case" not in text[engine.greedy_decode_loop]
    assert "stablehlo.sort" not in text[engine.greedy_decode_loop]


def test_unfiltered_decode_loop_samples_the_same_without_the_search(tiny):
    """decode_loop(filters=False), for slots that sample without top-k or top-p, draws the
    tokens the general loop draws, and its program leaves the filters' search out."""
    cfg, params = tiny
    prompts = _prompts(6, [5, 9], cfg.vocab_size)
    t, l = engine.pad_prompts(prompts)
    sp = SamplingParams(jnp.asarray([0.8, 1.3]), jnp.zeros(2, jnp.int32), jnp.ones(2))
    stop, key = jnp.asarray([-1], jnp.int32), jax.random.key(3)
    runs = []
    for extra in ((), (TUNING, False)):
        cache = init_cache(cfg, 2, 64)
        first, cache = engine.prefill_and_sample(cfg, params, cache, jnp.asarray(t), jnp.asarray(l), None, key, sp)
        state = engine.initial_state(first, jnp.asarray([12, 12]), stop, key, cache)
        out, state, cache = engine.decode_loop(cfg, params, cache, state, sp, stop, 11, *extra)
        runs.append(np.asarray(out))
        text = engine.decode_loop.trace(cfg, params, cache, state, sp, stop, 11, *extra).lower().as_text()
        assert ("@filtered_logits" in text) == (extra == ())
    np.testing.assert_array_equal(runs[1], runs[0])
    assert (runs[0] >= 0).all() and len({tuple(r) for r in runs[0]}) == 2


@pytest.mark.parametrize("loop", LOOPS)
def test_decode_loop_stops_when_the_cache_is_full(tiny, loop):
    cfg, params = tiny
    cache = init_cache(cfg, 1, 16)
    t, l = engine.pad_prompts(_prompts(5, [12], cfg.vocab_size))
    sp = SamplingParams.make(1)
    key = jax.random.key(0)
    first, cache = engine.prefill_and_sample(cfg, params, cache, jnp.asarray(t), jnp.asarray(l), None, key, sp)
    no_stop = jnp.asarray([-1], jnp.int32)
    state = engine.initial_state(first, jnp.asarray([100]), no_stop, key, cache)
    out, state, cache = loop(cfg, params, cache, state, sp, no_stop, 10)
    assert int(cache.lengths[0]) == 16
    assert (np.asarray(out)[0] >= 0).sum() == 4  # positions 12..15 were written, the 4th token ends it
    assert bool(state.done[0])


# --- bad input --------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        load_gguf(p)


def test_truncated_gguf(tiny_path, tmp_path):
    data = tiny_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFileError, match=r"cut\.gguf is truncated"):
        load_gguf(cut)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])
    with pytest.raises(ModelFileError, match=r"header\.gguf is truncated"):
        load_gguf(header_only)


def _tiny_writer(path, arch):
    w = GGUFWriter(str(path), arch)
    for key, value in dict(block_count=1, context_length=64, embedding_length=32, feed_forward_length=64,
                           **{"attention.head_count": 2, "attention.head_count_kv": 1}).items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    return w


def _finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture_is_named(tmp_path):
    p = tmp_path / "mamba.gguf"
    w = _tiny_writer(p, "mamba")
    w.add_tensor("token_embd.weight", np.ones((16, 32), np.float32))
    _finish(w)
    with pytest.raises(ModelFileError, match=r"unsupported architecture 'mamba'.*llama"):
        load_gguf(p)


def test_unsupported_tensor_type_is_named(tmp_path):
    p = tmp_path / "iq2.gguf"
    w = _tiny_writer(p, "llama")
    w.add_tensor("token_embd.weight", np.ones((16, 32), np.float32))
    # IQ2_XXS: 66 bytes per 256 values; rows of 256 values.
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 66), np.uint8), raw_dtype=QType.IQ2_XXS)
    _finish(w)
    with pytest.raises(TensorFormatError, match=r"blk\.0\.attn_q\.weight.*IQ2_XXS"):
        load_gguf(p)


def test_prompt_longer_than_the_context(tiny_path):
    model = rjax.load(tiny_path, progress=False)
    small = dataclasses.replace(model, config=dataclasses.replace(model.config, context_length=32))
    with pytest.raises(PromptTooLongError, match=r"40 tokens.*context.*32"):
        check_prompt_lengths(small, [list(range(40))])
    with pytest.raises(PromptTooLongError):
        rjax.generate(small, "x" * 200, raw=True, max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        check_prompt_lengths(small, [[]])


def test_cache_longer_than_the_context(tiny):
    cfg, _ = tiny
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        init_cache(cfg, 1, cfg.context_length + 1)


def test_program_params_dequantize_the_layers_once_and_change_no_logit(tiny, monkeypatch):
    """On the CPU the layers' weights are dequantized once for a run of programs, to what each
    program would dequantize on entry: prefill and decode logits bit-equal; the embedding and
    head stay as loaded. Without room for the copy (half the host's free memory), params as they are."""
    from rjax.engine import memory

    cfg, params = tiny
    dense = engine.program_params(params, jnp.float32)
    assert not any(isinstance(w, QTensor) for p in dense.layers
                   for w in jax.tree.leaves(p, is_leaf=lambda w: isinstance(w, QTensor)))
    assert any(isinstance(w, QTensor) for w in jax.tree.leaves(params.layers, is_leaf=lambda w: isinstance(w, QTensor)))
    assert dense.embed is params.embed and dense.lm_head is params.lm_head
    assert engine.program_params(dense, jnp.float32) is dense  # nothing left to convert
    t, l = engine.pad_prompts(_prompts(5, [7, 12], cfg.vocab_size))
    runs = []
    for p in (params, dense):
        cache = init_cache(cfg, 2, 64)
        logits, cache = engine.prefill(cfg, p, cache, jnp.asarray(t), jnp.asarray(l))
        step, _ = engine.decode_step(cfg, p, cache, jnp.argmax(logits, -1).astype(jnp.int32))
        runs.append((np.asarray(logits), np.asarray(step)))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    monkeypatch.setattr(engine, "host_available_bytes", lambda: 2 * memory.tree_bytes(params))
    assert engine.program_params(params, jnp.float32) is params


def test_gpu_weight_layout_consumes_what_it_replaces():
    """consume=True (a loader's own params): the same weights as without, each replaced plane
    freed once its new one exists, planes it keeps (scales) untouched, a weight met twice (tied)
    converted once; llama-8b-sized Q4_0 planes become words, smaller ones stay bytes."""
    from gguf_blocks.words import as_words
    from pallas_kernels.quant_matmul.testing import random_qtensor
    from rjax.math.layout import gpu_weight_layout

    def fresh():
        big = jax.tree.map(jnp.asarray, random_qtensor(QType.Q4_0, 4096, 4096, seed=1))   # 2**24 values
        small = jax.tree.map(jnp.asarray, random_qtensor(QType.Q4_0, 256, 512, seed=2))
        return {"big": big, "tied": (big, big), "small": small}

    want = gpu_weight_layout(fresh())
    params = fresh()
    got = gpu_weight_layout(params, consume=True)
    big = params["big"]
    assert big.planes.qs.is_deleted() and not big.planes.d.is_deleted()
    assert not params["small"].planes.qs.is_deleted() and got["small"] is params["small"]
    assert got["tied"][0] is got["tied"][1] is got["big"]
    assert got["big"].planes.qs.dtype == jnp.int32
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(want["big"].planes.qs),
                                  np.asarray(as_words(fresh()["big"]).planes.qs))


@pytest.mark.parametrize("model", ["smollm2_path", "gemma3_path"])
def test_gpu_weight_layout_gives_the_same_logits(model, request):
    """What `rjax.load` does on a GPU: `fuse_projections` stacks q/k/v and gate/up where their
    types agree (smollm2: all; gemma3's Q4_K_M: gate/up only, its v is another type), and
    `gpu_weight_layout` re-encodes Q4_K scales and views quant planes as words. No logit
    changes beyond float32 summation order."""
    from rjax.loading.loaders.gguf import load_gguf
    from rjax.math.layout import fuse_projections, gpu_weight_layout
    from gguf_blocks.formats import Q4_KChunks

    cfg, params, _ = load_gguf(request.getfixturevalue(model), progress=False)
    fused = gpu_weight_layout(fuse_projections(params))
    q4_k = [w for w in jax.tree.leaves(fused, is_leaf=lambda x: isinstance(x, QTensor))
            if isinstance(w, QTensor) and w.qtype == QType.Q4_K]
    assert all(isinstance(w.planes, Q4_KChunks) and w.planes.qs.dtype == jnp.int32 for w in q4_k)
    assert bool(q4_k) == (model == "gemma3_path")
    layer = fused.layers[0]
    assert layer.w_gate_up is not None and layer.w_gate is None and layer.w_up is None
    types = {w.qtype for w in (params.layers[0].wq, params.layers[0].wk, params.layers[0].wv)}
    assert (layer.wqkv is not None) == (len(types) == 1)
    if layer.wqkv is not None:
        assert layer.wqkv.shape == (cfg.head_dim * (cfg.n_heads + 2 * cfg.n_kv_heads), cfg.d_model)
    ids = _prompts(1, [9, 5], cfg.vocab_size)
    t, l = engine.pad_prompts(ids)
    outs = []
    for p in (params, fused):
        logits, cache = engine.prefill(cfg, p, init_cache(cfg, 2, 32), jnp.asarray(t), jnp.asarray(l))
        step, _ = engine.decode_step(cfg, p, cache, jnp.asarray([3, 4], jnp.int32))
        outs.append((np.asarray(logits), np.asarray(step)))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(a).max()))


def _decode_logits_with(cfg, params, ids, nxt, tuning, max_len=512):
    """Logits of one decode step (tokens nxt) after prefilling ids, every kernel choice planned
    from `tuning`, bfloat16 on this backend."""
    from rjax.math.model import forward
    from rjax.math.plan import plan_for

    run = jax.jit(forward, static_argnames=("cfg", "dtype", "plan"))
    t, l = engine.pad_prompts(ids)
    B, T = t.shape
    pos = jnp.where(jnp.arange(T)[None] < jnp.asarray(l)[:, None], jnp.arange(T)[None], -1)
    cache = init_cache(cfg, B, max_len, dtype=jnp.bfloat16)
    plan = plan_for(cfg, params, B, T, jnp.bfloat16, tuning=tuning, cache_len=max_len)
    _, cache = run(cfg, params, cache, jnp.asarray(t), pos, dtype=jnp.bfloat16, plan=plan)
    cache = cache.advance(None, jnp.asarray(l))
    plan = plan_for(cfg, params, B, 1, jnp.bfloat16, tuning=tuning, cache_len=max_len)
    logits, _ = run(cfg, params, cache, jnp.asarray(nxt, jnp.int32)[:, None], cache.lengths[:, None],
                    dtype=jnp.bfloat16, plan=plan)
    return np.asarray(logits[:, 0], np.float32)


@pytest.mark.gpu
def test_gpu_int8_decode_paths_agree(tmp_path):
    """Batch-1 decode on the GPU, llama-1b layers in Q4_K: activations rounded to int8 by the
    attention kernel and by the output and down products' kernels with the norm pending (the
    default), by the RMS-norm and GLU kernels (QuantizedX), by the int8 kernel itself, or not
    at all (float kernel) give the same logits up to the int8 rounding of the activations."""
    from pallas_kernels.quant_matmul import TUNING
    from rjax.loading.synth import write_synthetic

    path = write_synthetic(tmp_path / "l1b.gguf", "llama-1b", "q4_k", seed=1, n_layers=2, vocab_size=512,
                           tokenizer_from="builtin")
    model = rjax.load(path, progress=False)
    cfg, params = model.config, model.params
    ids = _prompts(2, [7], cfg.vocab_size)
    never = {t: 2**62 for t, _ in TUNING.int8_producer_min_values}
    variants = {"add_norm": TUNING.replace(int8_producer_min_values=()),
                "bf16_attention_out": TUNING.replace(int8_producer_min_values=(), quantized_attention_out=False),
                "producer": TUNING.replace(int8_producer_min_values=(), add_norm_max_m=0,
                                           quantized_attention_out=False),
                "in_kernel": TUNING.replace(int8_producer_min_values=never),
                "float": TUNING.replace(int8_max_m=())}
    out = {name: _decode_logits_with(cfg, params, ids, [3], tuning) for name, tuning in variants.items()}
    scale = float(np.abs(out["float"]).max())
    np.testing.assert_allclose(out["add_norm"], out["producer"], rtol=0, atol=2e-2 * scale)
    np.testing.assert_allclose(out["add_norm"], out["bf16_attention_out"], rtol=0, atol=2e-2 * scale)
    # The int8 kernel rounds x from its bfloat16 values, the producers from float32: each is
    # held against the float kernel.
    for name in ("producer", "in_kernel", "add_norm"):
        np.testing.assert_allclose(out[name], out["float"], rtol=0, atol=5e-2 * scale, err_msg=name)


@pytest.mark.gpu
def test_gpu_float_decode_paths_agree(tmp_path):
    """Batch-1 decode on the GPU, smollm2 layers in Q4_1 (the float kernel's CUDA-core tiles):
    the norms between layers left to the next product (PendingNorm) and the GLU to the down
    product (GatedX), the defaults, against either or both off: the same logits up to bf16
    rounding."""
    from pallas_kernels.quant_matmul import TUNING
    from rjax.loading.synth import write_synthetic

    path = write_synthetic(tmp_path / "sm.gguf", "smollm2-135m", "q4_1", seed=3, n_layers=3, vocab_size=512,
                           tokenizer_from="builtin")
    model = rjax.load(path, progress=False)
    cfg, params = model.config, model.params
    ids = _prompts(3, [9], cfg.vocab_size)
    variants = {"default": TUNING, "no_pending": TUNING.replace(pending_norm_max_m=0),
                "no_gated": TUNING.replace(gated_x_max_m=0),
                "neither": TUNING.replace(pending_norm_max_m=0, gated_x_max_m=0)}
    out = {name: _decode_logits_with(cfg, params, ids, [3], tuning) for name, tuning in variants.items()}
    scale = float(np.abs(out["neither"]).max())
    for name in ("default", "no_pending", "no_gated"):
        np.testing.assert_allclose(out[name], out["neither"], rtol=0, atol=2e-2 * scale, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,quant,batch", [("smollm2-135m", "q8_0", 1), ("llama-1b", "q4_k", 3),
                                               ("qwen2.5-1.5b", "q8_0", 2), ("smollm2-135m", "q4_1", 1)])
def test_gpu_decode_matches_longer_prefill(tmp_path, shape, quant, batch):
    """Decode on the GPU (rotation + cache append kernel, one-token attention kernel, int8 GEMVs)
    against a prefill of the prompt plus that token (XLA's rotation and scatter, the prefill
    attention kernel, float products): the same logits up to the int8 rounding of activations.
    The shapes cover both rotation pairings, a group of 3 query heads and QKV biases; smollm2 in
    Q4_1 decodes on the float kernel."""
    from rjax.loading.synth import write_synthetic

    path = write_synthetic(tmp_path / "m.gguf", shape, quant, seed=2, n_layers=2, vocab_size=512,
                           tokenizer_from="builtin")
    model = rjax.load(path, progress=False)
    cfg, params = model.config, model.params
    ids = _prompts(3, [9, 30, 17][:batch], cfg.vocab_size)
    nxt = [5, 11, 200][:batch]
    t, l = engine.pad_prompts(ids)
    cache = init_cache(cfg, batch, 64, dtype=jnp.bfloat16)
    _, cache = engine.prefill(cfg, params, cache, jnp.asarray(t), jnp.asarray(l))
    got, cache = engine.decode_step(cfg, params, cache, jnp.asarray(nxt, jnp.int32))
    t2, l2 = engine.pad_prompts([p + [n] for p, n in zip(ids, nxt)])
    want, full = engine.prefill(cfg, params, init_cache(cfg, batch, 64, dtype=jnp.bfloat16), jnp.asarray(t2),
                                jnp.asarray(l2))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-2 * float(np.abs(want).max()))
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(l2))
    for layer in range(cfg.n_layers):  # the appended (rotated) keys and the values, position by position
        for c, f in ((cache.k[layer], full.k[layer]), (cache.v[layer], full.v[layer])):
            c, f = np.asarray(c, np.float32), np.asarray(f, np.float32)
            for b, n in enumerate(l2):
                np.testing.assert_allclose(c[b, :, :n], f[b, :, :n], rtol=0, atol=5e-2 * np.abs(f[b, :, :n]).max())


def test_generation_launches_each_dispatch_before_reading_back_the_last(tmp_path, monkeypatch):
    """Greedy generation runs the server's decode_dispatch, launching a dispatch before it reads the one
    before back and none past the token budget, and yields the tokens one long dispatch gives;
    after a stop token the dispatch launched ahead adds nothing to the final cache."""
    from rjax.engine import slots
    from rjax.loading.synth import write_synthetic
    from rjax.runtime.generation import stream_ids

    path = write_synthetic(tmp_path / "tiny.gguf", "smollm2-135m", "q4_1", n_layers=2, vocab_size=512,
                           tokenizer_from="builtin")
    m = rjax.load(path, progress=False)
    m = dataclasses.replace(m, tokenizer=dataclasses.replace(m.tokenizer, eos_ids=frozenset()))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]

    def joined(steps):
        parts = list(steps)
        return [sum((p[i] for p in parts), []) for i in range(len(parts[0]))]

    whole = joined(stream_ids(m, prompts, max_new_tokens=11, steps_per_dispatch=16))
    events = []
    real_loop, real_get = slots.decode_dispatch, jax.device_get

    class Counted:  # the loop, noting each call (precompiling reaches through it for .trace)
        def __call__(self, *a):
            events.append("launch")
            return real_loop(*a)

        def __getattr__(self, name):
            return getattr(real_loop, name)

    monkeypatch.setattr(slots, "decode_dispatch", Counted())
    monkeypatch.setattr(jax, "device_get", lambda x: (events.append("read"), real_get(x))[1])
    stats: dict = {}
    assert joined(stream_ids(m, prompts, max_new_tokens=11, steps_per_dispatch=3, stats=stats)) == whole
    # 10 decode steps at 3 a dispatch: 4 dispatches, each launched before the one before is read.
    assert events == ["launch", "launch", "read", "launch", "read", "launch", "read", "read"]
    assert np.asarray(stats["cache"].lengths).tolist() == [len(p) + 10 for p in prompts]

    # A stop token the first prompt first generates after its first dispatch: the dispatch after
    # the one that reads it back was launched already, and adds nothing.
    stop = next(t for i, t in enumerate(whole[0]) if i >= 3 and t not in whole[0][:i])
    end = whole[0].index(stop) + 1
    m = dataclasses.replace(m, tokenizer=dataclasses.replace(m.tokenizer, eos_ids=frozenset({stop})))
    events.clear()
    (got,) = joined(stream_ids(m, prompts[:1], max_new_tokens=40, steps_per_dispatch=3, stats=stats))
    assert got == whole[0][:end]
    reads = -(-(end - 1) // 3)
    assert events.count("read") == reads and events.count("launch") == reads + 1
    assert np.asarray(stats["cache"].lengths).tolist() == [len(prompts[0]) + end - 1]


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_generate_of_one_prompt_samples_as_the_server_with_the_same_seed(tiny_path, speculative):
    """rjax.generate of one prompt runs the server's slot programs over a batch of one row, so a
    sampled generation of seed s gives the tokens a ServingEngine gives a request of seed s
    (plain decoding and speculative decoding alike)."""
    from rjax.runtime.generation import cache_length
    from rjax.runtime.serving import ServingConfig, ServingEngine

    m = rjax.load(tiny_path, progress=False)
    text = "a b c a b c a"
    ids = m.tokenizer.encode(text)
    kw = dict(max_new_tokens=12, temperature=0.9, top_p=0.95)
    got = rjax.generate(m, text, raw=True, seed=2**40 + 7, speculative=speculative, steps_per_dispatch=4,
                        **kw, **(dict(draft_tokens=3) if speculative else {}))
    config = ServingConfig(n_slots=1, max_len=cache_length(len(ids) + 12, m.config.context_length), page_size=None,
                           steps_per_dispatch=4, speculative=speculative, draft_tokens=3, prefix_cache=False)
    eng = ServingEngine(m.config, m.params, config, stop_ids=sorted(m.tokenizer.eos_ids))
    eng.submit(ids, seed=2**40 + 7, **kw)
    [want] = [e.completion for e in eng.run() if e.finished]
    assert got.tokens == want.tokens and len(got.tokens) > 1
