"""GPU smoke tier: every public entry point once on the GPU, against the float32 reference path.

    pytest -m gpu_smoke -n 4     (on a GPU machine; under 5 minutes on an H100)

Almost all of its time is XLA compiling programs on the host, so it runs in several processes.

Small synthetic models of real widths: smollm2-135m's shape in Q4_1 (the default model's
kernels: the float kernel's CUDA-core tiles, the norm and GLU left to the next product) and
llama-1b's in Q4_K (the int8 GEMV with the add + norm in the product at one row, bf16x2 and
wgmma batched). The reference is the same model run by the CPU's path (every product
dequantized then multiplied, float32 activations, no fused kernels) on the same device. Bounds:
logits within 5% of their scale (bfloat16 activations and, on the int8 kernels, activations
rounded to int8 per 32 values); greedy tokens equal up to the first step where the reference's
top-2 margin is under that bound (a near-tie either way may go).
"""
from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rjax
from rjax.loading.synth import write_synthetic
from rjax.math.cache import init_cache
from rjax.math.model import forward
from rjax.math.plan import plan_for

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_smoke]
TOL = 5e-2
N_NEW = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("smoke")
    out = {}
    for shape, mix in (("smollm2-135m", "q4_1"), ("llama-1b", "q4_k")):
        path = write_synthetic(d / f"{shape}.gguf", shape, mix, seed=4, n_layers=2, vocab_size=512,
                               tokenizer_from="builtin")
        out[shape] = rjax.load(path, progress=False)
    return out


_RUN = jax.jit(forward, static_argnames=("cfg", "dtype", "plan"))
PROMPT_PAD = 64


def _reference_greedy(model, ids: list[int], n: int):
    """Greedy continuation on the reference path, float32, with each step's logits (prompts
    padded to PROMPT_PAD, so that every prompt shares one program)."""
    cfg, params = model.config, model.params
    cache = init_cache(cfg, 1, 256, jnp.float32)
    assert len(ids) <= PROMPT_PAD
    toks = jnp.asarray([ids + [0] * (PROMPT_PAD - len(ids))], jnp.int32)
    pos = jnp.where(jnp.arange(PROMPT_PAD) < len(ids), jnp.arange(PROMPT_PAD), -1)[None].astype(jnp.int32)
    out, steps, last_at = [], [], len(ids) - 1
    for t in range(n):
        plan = plan_for(cfg, params, 1, toks.shape[1], jnp.float32, gpu=False)
        logits, cache = _RUN(cfg, params, cache, toks, pos, dtype=jnp.float32, plan=plan)
        last = np.asarray(logits[0, last_at], np.float64)
        steps.append(last)
        out.append(int(last.argmax()))
        toks, pos, last_at = jnp.asarray([[out[-1]]], jnp.int32), jnp.asarray([[len(ids) + t]], jnp.int32), 0
    return out, steps


def _check_greedy(got: list[int], want: list[int], steps) -> None:
    for t, (g, w, logits) in enumerate(zip(got, want, steps)):
        if g == w:
            continue
        top2 = np.sort(logits)[-2:]
        margin, scale = top2[1] - top2[0], np.abs(logits).max()
        assert margin < TOL * scale, f"step {t}: token {g} against {w} with a top-2 margin of {margin:.4f}"
        return  # a near-tie: the sequences may part from here


PROMPTS = [f"Item {i}: the quick brown fox" + " jumps" * (i % 5) for i in range(33)]
KW = dict(raw=True, max_new_tokens=N_NEW, temperature=0.0)


def _check_against_reference(model, results, prompts):
    for r, p in zip(results, prompts):
        want, steps = _reference_greedy(model, model.tokenizer.encode(p), N_NEW)
        _check_greedy(r.tokens[:N_NEW], want, steps)


def test_generate_list_of_one(models):
    """A list of one prompt: the serving engine at one row on a paged cache (where a norm left
    to the next product once lost the residual)."""
    model = models["smollm2-135m"]
    [r] = rjax.generate(model, [PROMPTS[0]], **KW)
    assert r.finish_reason == "length" and len(r.tokens) == N_NEW
    _check_against_reference(model, [r], PROMPTS[:1])


def test_generate_string_and_stream(models):
    model = models["smollm2-135m"]
    one = rjax.generate(model, PROMPTS[0], **KW)
    _check_against_reference(model, [one], PROMPTS[:1])
    assert "".join(rjax.stream(model, PROMPTS[0], **KW)) == one.text


def test_generate_two_and_33_prompts(models):
    model = models["smollm2-135m"]
    two = rjax.generate(model, PROMPTS[1:3], **KW)
    _check_against_reference(model, two, PROMPTS[1:3])
    many = rjax.generate(model, PROMPTS, **KW)
    assert len(many) == 33
    # A random model may pick its end-of-sequence token within N_NEW steps: then "stop", early.
    assert all((r.finish_reason, len(r.tokens)) == ("length", N_NEW) or
               (r.finish_reason == "stop" and len(r.tokens) <= N_NEW) for r in many), \
        [(r.finish_reason, len(r.tokens)) for r in many]
    _check_against_reference(model, [many[0], many[32]], [PROMPTS[0], PROMPTS[32]])


def test_speculative_generate_one_and_two_prompts(models):
    """Prompt lookup: one prompt (the batch-1 loop) and a list of two (the serving engine's
    slots), each verification a pass of K + 1 positions; greedy tokens as the reference's."""
    model = models["smollm2-135m"]
    one = rjax.generate(model, PROMPTS[0], speculative="ngram", draft_tokens=4, **KW)
    two = rjax.generate(model, PROMPTS[:2], speculative="ngram", draft_tokens=4, **KW)
    _check_against_reference(model, [one, *two], [PROMPTS[0], *PROMPTS[:2]])
    assert one.speculative["drafted"] > 0 and sum(r.speculative["drafted"] for r in two) > 0


def test_serving_engine_with_mid_run_arrivals(models):
    """Requests arriving while others decode: each greedy completion equals its solo run."""
    model = models["smollm2-135m"]
    cfg, params = model.config, model.params
    eng = rjax.ServingEngine(cfg, params, rjax.ServingConfig(n_slots=4, max_len=128, steps_per_dispatch=4,
                                                             kv_dtype="bfloat16"))
    prompts = [[5 + i, 17, 33 + 2 * i, 9] for i in range(6)]
    ids = {eng.submit(prompts[0], max_new_tokens=10): 0, eng.submit(prompts[1], max_new_tokens=10): 1}
    done = {}
    steps = 0
    while eng.has_work:
        for e in eng.step():
            if e.finished:
                done[ids[e.request_id]] = e.completion.tokens
        steps += 1
        if steps in (1, 2):
            for i in (2 * steps, 2 * steps + 1):
                ids[eng.submit(prompts[i], max_new_tokens=10)] = i
    assert sorted(done) == list(range(6))
    for i, p in enumerate(prompts):
        want, steps_logits = _reference_greedy(model, p, 10)
        _check_greedy(done[i], want, steps_logits)


def test_score_and_perplexity(models):
    """score and perplexity in bfloat16 against float32 on the same GPU: log-probabilities within
    the bound, perplexities within 2%."""
    from rjax.runtime.scoring import perplexity_of_ids, score_ids

    model = models["llama-1b"]
    cfg, params = model.config, model.params
    prompts, conts = [[1, 5, 9, 14], [3, 3, 8]], [[20, 21], [40, 41, 42]]
    got = score_ids(cfg, params, prompts, conts, dtype=jnp.bfloat16)
    want = score_ids(cfg, params, prompts, conts, dtype=jnp.float32)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=TOL * max(1.0, float(np.abs(w).max())))
    tokens = [int(t) for t in (np.arange(300) * 37 + 11) % 500]
    p16 = perplexity_of_ids(cfg, params, tokens, ctx=128, progress=False, dtype=jnp.bfloat16).ppl
    p32 = perplexity_of_ids(cfg, params, tokens, ctx=128, progress=False, dtype=jnp.float32).ppl
    assert abs(p16 / p32 - 1) < 0.02, (p16, p32)


@pytest.mark.parametrize("rows", [1, 3, 33, 80])
@pytest.mark.parametrize("shape", ["smollm2-135m", "llama-1b"])
def test_decode_and_prefill_logits_against_the_reference(models, shape, rows):
    """The forward pass at 1 row (int8 GEMV / CUDA-core tiles, norms and GLU deferred), 3 rows
    (bf16x2), 33 (wgmma), 80 (the prefill GEMM and flash attention): logits within the bound."""
    model = models[shape]
    cfg, params = model.config, model.params
    B, T = (rows, 1) if rows <= 64 else (2, rows // 2)
    toks = (jnp.arange(B * T, dtype=jnp.int32).reshape(B, T) * 13 + 7) % 500
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    outs = []
    for dtype, gpu in ((jnp.bfloat16, True), (jnp.float32, False)):
        plan = plan_for(cfg, params, B, T, dtype, gpu=gpu, cache_len=128)
        logits, _ = jax.jit(forward, static_argnames=("cfg", "dtype", "plan"))(
            cfg, params, init_cache(cfg, B, 128, dtype), toks, pos, dtype=dtype, plan=plan)
        outs.append(np.asarray(logits, np.float32))
    scale = float(np.abs(outs[1]).max())
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=TOL * scale, err_msg=f"{shape} {rows} rows")




def test_loaded_weights_are_the_files_planes_in_the_gpu_layout(models):
    """`rjax.load` on a GPU: block bytes split into planes on the device, q/k/v stacked and the
    GPU layout made by jitted programs. The same bits as the file's planes split on the host,
    stacked by numpy and laid out by the eager functions that define the layout."""
    from gguf_blocks.qtensor import QTensor
    from gguf_blocks.reference import q4_k_chunks
    from gguf_blocks.words import as_words
    from pallas_kernels.quant_matmul.gemv import reads_words
    from rjax.loading.loaders.gguf import config_from_reader, load_params, open_gguf

    model = models["llama-1b"]
    reader = open_gguf(model.source)
    host = load_params(reader, config_from_reader(reader, model.source), progress=False, on_device=False)
    layer = host.layers[0]
    qkv = jax.tree.map(lambda *p: np.concatenate(p, axis=0), *[w.planes for w in (layer.wq, layer.wk, layer.wv)])
    for got, w in ((model.params.layers[0].wqkv, QTensor(qkv, layer.wq.qtype, (sum(w.shape[0] for w in (
            layer.wq, layer.wk, layer.wv)), layer.wq.shape[1]))), (model.params.embed, host.embed),
            (model.params.layers[1].w_down, host.layers[1].w_down)):
        want = q4_k_chunks(jax.tree.map(jnp.asarray, w))
        want = as_words(want) if reads_words(want.qtype, *want.shape) else want
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.dtype == x.dtype and g.shape == x.shape
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(x).view(np.uint8))


def test_kernel_families_against_their_references():
    """Each kernel family once through its public entry point, compiled, against its reference."""
    from gguf import GGMLQuantizationType as QType

    from pallas_kernels.attention import attention, paged_attention
    from pallas_kernels.int8_activations import dequantize_x, quantize
    from pallas_kernels.kv_append import rope_append
    from pallas_kernels.quant_matmul import qmatmul
    from pallas_kernels.quant_matmul.testing import random_qtensor
    from pallas_kernels.rms_norm import add_rms_norm
    from rjax.math.layout import gpu_weight_layout

    rng = np.random.default_rng(0)
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))  # noqa: E731
                             / np.linalg.norm(np.asarray(b, np.float64)))
    for qtype, n, k in ((QType.Q4_K, 8192, 2048), (QType.Q4_1, 1536, 576), (QType.Q8_0, 4096, 4096)):
        w = gpu_weight_layout(jax.tree.map(jnp.asarray, random_qtensor(qtype, n, k, seed=1)))
        for m in (1, 3, 33, 100):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            got = jax.jit(qmatmul)(x, w)
            want = qmatmul(x.astype(jnp.float32), w, implementation="reference")
            assert rel(got, want) < 2e-2, (qtype.name, m)
    q = jnp.asarray(rng.standard_normal((2, 1, 8, 64)), jnp.bfloat16)
    kc = jnp.asarray(rng.standard_normal((2, 2, 256, 64)), jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal((2, 2, 256, 64)), jnp.bfloat16)
    for T in (1, 64):
        qT = jnp.asarray(rng.standard_normal((2, T, 8, 64)), jnp.bfloat16)
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + 100, (2, T))
        kw = dict(scale=0.125)
        got = attention(qT, kc, vc, pos, pos[:, -1] + 1, **kw)
        want = attention(qT, kc, vc, pos, pos[:, -1] + 1, **kw, implementation="reference")
        assert rel(got, want) < 2e-2, ("attention", T)
    pages = kc.reshape(8, 2, 64, 64)  # any values: 8 pages of 64 positions
    tables = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    pos = jnp.asarray([[100], [127]], jnp.int32)
    got = paged_attention(q, pages, pages, tables, pos, pos[:, 0] + 1, scale=0.125)
    want = paged_attention(q, pages, pages, tables, pos, pos[:, 0] + 1, scale=0.125, implementation="reference")
    assert rel(got, want) < 2e-2
    x = jnp.asarray(rng.standard_normal((4, 2048)), jnp.float32)
    parts = jnp.asarray(rng.standard_normal((2, 4, 2048)), jnp.float32)
    nw = jnp.asarray(rng.standard_normal(2048), jnp.float32)
    for quant in (False, True):
        (xs, h), (xr, hr) = (add_rms_norm(x, parts, nw, 1e-5, jnp.bfloat16, quantize=quant, implementation=i)
                             for i in ("pallas", "reference"))
        np.testing.assert_allclose(np.asarray(xs), np.asarray(xr), rtol=1e-5, atol=1e-5)
        h, hr = (dequantize_x(h), dequantize_x(hr)) if quant else (h, hr)
        assert rel(h, hr) < 1e-2
    gu = jnp.asarray(rng.standard_normal((4, 2 * 2048)), jnp.bfloat16)
    assert rel(dequantize_x(quantize(gu, "silu", implementation="pallas")),
               dequantize_x(quantize(gu, "silu", implementation="reference"))) < 1e-2
    parts = jnp.asarray(rng.standard_normal((2, 2, 1, (8 + 2 * 2) * 64)), jnp.float32)
    inv = 1.0 / (10000.0 ** (jnp.arange(0, 64, 2, dtype=jnp.float32) / 64))
    pos = jnp.asarray([[5], [9]], jnp.int32)
    outs = [rope_append(parts, None, pos, kc, vc, inv, jnp.arange(2), n_heads=8, pairing="halves",
                        dtype=jnp.bfloat16, implementation=i) for i in ("pallas", "reference")]
    for a, b in zip(*(o[:3] for o in outs)):  # q, k, v (a float cache's scales are None)
        assert rel(a, b) < 1e-2


def test_cli_generate_and_bench_at_two_layers(models, tmp_path):
    """`rjax generate --json` and `rjax bench` on a 2-layer model, as a user runs them."""
    path = write_synthetic(tmp_path / "b.gguf", "llama-1b", "q4_k", seed=5, n_layers=2, vocab_size=512,
                           tokenizer_from="builtin")
    gen = subprocess.run([sys.executable, "-m", "rjax.cli", "generate", "-m", str(path), "--raw", "--json",
                          "--max-new-tokens", "8", "Hello there"], capture_output=True, text=True, timeout=240)
    assert gen.returncode == 0, gen.stderr[-2000:]
    result = json.loads(gen.stdout.strip().splitlines()[-1])
    assert len(result["tokens"]) >= 1 and result["finish_reason"] in ("length", "stop", "context")
    out = tmp_path / "bench.json"
    bench = subprocess.run([sys.executable, "-m", "rjax.cli", "bench", "-m", str(path), "--batch", "1,4",
                            "--prompt-len", "64", "--gen", "16", "--steps-per-dispatch", "16", "--repeats", "1",
                            "--json", str(out), "-q"], capture_output=True, text=True, timeout=240)
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert out.exists() and json.loads(out.read_text())
