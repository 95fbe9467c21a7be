"""Hugging Face checkpoint directories: real checkpoints made from the catalog GGUFs against
transformers on the same directory and against rjax on the GGUF; bf16/f16 weights; shards;
Gemma 3's multimodal layout; quantize-on-load; `describe_hf_dir`; and a clear error for each
kind of bad input.
"""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import quants
from safetensors.numpy import load_file, save_file

from rjax.cli.info import format_info, model_info, natural_key
from rjax.engine import steps
from rjax.loading.loaders.gguf import ModelFileError, load_gguf
from rjax.loading.loaders.safetensors import describe_hf_dir, load_hf_dir
from rjax.math.cache import init_cache
from gguf_blocks.qtensor import QTensor
from gguf_blocks.reference import dequantize
from tests.compare import assert_close, check_against_oracle, greedy_continuations, relative_error
from tests.oracle.client import (oracle_logits, oracle_random_model, oracle_random_qwen2, oracle_save_pretrained,
                                 oracle_tokenize)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "Translate to German: The weather is nice today.",
]
DECODE_STEPS = 16
GREEDY = 32
MAX_LEN = 128


def _prefill_logits(cfg, params, ids):
    cache = init_cache(cfg, len(ids), MAX_LEN)
    tokens, lengths = steps.pad_prompts(ids)
    logits, _ = steps.prefill(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths))
    return np.asarray(logits)


def _assert_described(info, described):
    """`model_info` of a directory: `describe_hf_dir`'s keys, the tensors in natural order, and the summary's own."""
    assert {k: info[k] for k in described if k != "tensors"} == {k: v for k, v in described.items() if k != "tensors"}
    assert info["tensors"] == sorted(described["tensors"], key=lambda t: natural_key(t["name"]))
    assert {"chat_template", "quant", "memory"} <= set(info)


# --- real checkpoints --------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real(request):
    gguf_path = request.getfixturevalue(f"{request.param}_path")
    directory = oracle_save_pretrained(gguf_path)
    ids = oracle_tokenize(directory, PROMPTS)["ids_with_special"]
    cfg, params = load_hf_dir(directory, progress=False)
    yield request.param, gguf_path, directory, ids, cfg, params
    del params


@pytest.mark.slow
@pytest.mark.oracle
def test_real_checkpoint_matches_transformers(real):
    name, _, directory, ids, cfg, params = real
    ref = oracle_logits(directory, ids, DECODE_STEPS, greedy_tokens=GREEDY)
    err = check_against_oracle(cfg, params, ids, ref, max_len=MAX_LEN, decode_steps=DECODE_STEPS, greedy=GREEDY)
    print(f"{name} safetensors vs transformers: max relative logit error {err:.2e}")


@pytest.mark.slow
def test_real_checkpoint_matches_rjax_on_the_gguf(real):
    name, gguf_path, _, ids, cfg, params = real
    gcfg, gparams, _ = load_gguf(gguf_path, progress=False)
    same = ("arch", "n_layers", "d_model", "d_ff", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
            "context_length", "layer_windows", "layer_rope_theta", "layer_rope_linear", "qkv_bias", "qk_norm",
            "post_norms", "activation", "embed_scale", "tie_embeddings", "attn_scale")
    assert {k: getattr(cfg, k) for k in same} == {k: getattr(gcfg, k) for k in same}
    assert cfg.rms_eps == pytest.approx(gcfg.rms_eps) and cfg.rope_pairing == "halves"
    err = assert_close(_prefill_logits(cfg, params, ids), _prefill_logits(gcfg, gparams, ids), f"{name} dir vs gguf")
    np.testing.assert_array_equal(greedy_continuations(cfg, params, ids, GREEDY, max_len=MAX_LEN),
                                  greedy_continuations(gcfg, gparams, ids, GREEDY, max_len=MAX_LEN))
    print(f"{name} safetensors vs GGUF (both rjax): max relative logit error {err:.2e}")


@pytest.mark.slow
def test_describe_matches_gguf_info(real):
    name, gguf_path, directory, _, cfg, _ = real
    info, ginfo = model_info(str(directory)), model_info(str(gguf_path))
    assert set(ginfo) <= set(info) and info["model_type"] in ("llama", "gemma3_text")
    assert info["architecture"] == ginfo["architecture"] == cfg.arch
    assert info["parameters"] == ginfo["parameters"]  # the same tensors, de-quantized
    assert info["tensor_bytes"] == 4 * info["parameters"] and info["tensor_types"]["F32"]["count"] == len(info["tensors"])
    for key in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "layer_windows"):
        assert info["config"][key] == ginfo["config"][key], key
    _assert_described(info, describe_hf_dir(directory))  # `rjax info DIR` goes through describe_hf_dir
    assert f"architecture   {cfg.arch}" in format_info(info)


@pytest.mark.slow
def test_quantize_q8_0_on_load_stays_close(smollm2_path):
    """Q8_0 at load: exactly the dense model with every matrix put through gguf's Q8_0 round trip,
    and within a stated bound of the dense model's logits."""
    directory = oracle_save_pretrained(smollm2_path)
    ids = oracle_tokenize(directory, PROMPTS)["ids_with_special"]
    cfg, dense = load_hf_dir(directory, progress=False)
    want = _prefill_logits(cfg, dense, ids)

    def round_trip(w):
        if w.ndim != 2:
            return w
        host = np.asarray(w)
        return jnp.asarray(quants.dequantize(quants.quantize(host, QType.Q8_0), QType.Q8_0).reshape(host.shape))

    simulated = _prefill_logits(cfg, jax.tree.map(round_trip, dense), ids)
    del dense
    qcfg, quant = load_hf_dir(directory, progress=False, quantize="q8_0")
    assert qcfg == cfg
    layer = quant.layers[0]
    assert all(isinstance(w, QTensor) and w.qtype == QType.Q8_0
               for w in (quant.embed, layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down))
    assert layer.attn_norm.dtype == jnp.float32
    got = _prefill_logits(qcfg, quant, ids)
    assert relative_error(got, simulated) < 1e-5
    err = relative_error(got, want)
    # measured 2.75e-2 (0.63 of a max logit 23; per prompt 1.3e-2 .. 3.2e-2): 8-bit weights over 30 layers
    assert err < 4e-2, err
    print(f"smollm2 quantized to Q8_0 at load: max relative logit error vs dense {err:.2e}")


# --- random checkpoints -------------------------------------------------------------------------------


@pytest.mark.oracle
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_weights_stay_half_and_match_transformers(dtype):
    directory = oracle_random_qwen2(seed=4, tie_word_embeddings=False, dtype=dtype)
    cfg, params = load_hf_dir(directory, progress=False)
    assert params.layers[0].wq.dtype == jnp.dtype(dtype) and params.lm_head.dtype == jnp.dtype(dtype)
    assert params.layers[0].attn_norm.dtype == jnp.float32 and params.layers[0].bq.dtype == jnp.float32
    ids = [np.random.default_rng(1).integers(0, cfg.vocab_size, n).tolist() for n in (5, 21)]
    ref = oracle_logits(directory, ids, DECODE_STEPS)
    err = check_against_oracle(cfg, params, ids, ref, max_len=64, decode_steps=DECODE_STEPS)
    print(f"random qwen2 in {dtype}: max relative logit error {err:.2e}")


@pytest.fixture(scope="module")
def qwen2_dir():
    return oracle_random_qwen2(seed=3, tie_word_embeddings=False)


def _assert_same_params(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_shards_load_like_one_file(qwen2_dir, tmp_path):
    tensors = load_file(qwen2_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, tmp_path / file)
    weight_map = {n: f for f, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(qwen2_dir / "config.json", tmp_path / "config.json")
    cfg, params = load_hf_dir(tmp_path, progress=False)
    want_cfg, want = load_hf_dir(qwen2_dir, progress=False)
    assert cfg == want_cfg
    _assert_same_params(params, want)


@pytest.mark.parametrize("quantize", [None, "q8_0"])
def test_chunked_reads_load_the_same_params(qwen2_dir, monkeypatch, quantize):
    """Tensors read in row chunks into donated device buffers, with the file re-mapped every few
    KiB, give exactly what whole-tensor reads give (the real checkpoints take this path for their
    big tensors)."""
    import rjax.loading.loaders.safetensors as st

    _, want = load_hf_dir(qwen2_dir, progress=False, quantize=quantize)
    monkeypatch.setattr(st, "_CHUNK_BYTES", 8000)   # 31 rows of the 64-wide f32 weights
    monkeypatch.setattr(st, "_REMAP_BYTES", 20000)
    _, params = load_hf_dir(qwen2_dir, progress=False, quantize=quantize)
    _assert_same_params(params, want)


def test_describe_small_checkpoint_and_rjax_load(qwen2_dir):
    import rjax

    raw = load_file(qwen2_dir / "model.safetensors")
    info = describe_hf_dir(qwen2_dir)
    assert info["architecture"] == "qwen2" and info["model_type"] == "qwen2"
    assert info["parameters"] == sum(a.size for a in raw.values())
    assert info["tensor_types"] == {"F32": {"count": len(raw), "bytes": sum(a.nbytes for a in raw.values())}}
    assert {t["name"]: tuple(t["shape"]) for t in info["tensors"]} == {n: a.shape for n, a in raw.items()}
    assert info["file_bytes"] == (qwen2_dir / "model.safetensors").stat().st_size
    _assert_described(model_info(str(qwen2_dir)), info)
    model = rjax.load(qwen2_dir, progress=False)  # the public entry point: params + tokenizer from the directory
    cfg, params = load_hf_dir(qwen2_dir, progress=False)
    assert model.config == cfg
    _assert_same_params(model.params, params)


GEMMA3_SMALL = dict(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_gemma3_multimodal_layout_loads_its_language_model(prefix, tmp_path):
    directory = oracle_random_model("gemma3_text", seed=11, **GEMMA3_SMALL)
    text = json.loads((directory / "config.json").read_text())
    tie = text.pop("tie_word_embeddings")
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8}, "tie_word_embeddings": tie}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {prefix + n.removeprefix("model."): t for n, t in load_file(directory / "model.safetensors").items()}
    outer = "model." if prefix.startswith("model.") else ""  # where the vision tower sits beside it
    tensors[outer + "vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((8, 3, 2, 2), np.float32)
    tensors[outer + "multi_modal_projector.mm_input_projection_weight"] = np.zeros((8, 64), np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    cfg, params = load_hf_dir(tmp_path, progress=False)
    want_cfg, want = load_hf_dir(directory, progress=False)
    assert cfg == want_cfg
    _assert_same_params(params, want)


def test_gemma3_norms_get_plus_one(tmp_path):
    directory = oracle_random_model("gemma3_text", seed=11, **GEMMA3_SMALL)
    raw = load_file(directory / "model.safetensors")
    _, params = load_hf_dir(directory, progress=False)
    layer = params.layers[1]
    for field, name in [("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
                        ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffn_norm", "post_feedforward_layernorm"),
                        ("q_norm", "self_attn.q_norm"), ("k_norm", "self_attn.k_norm")]:
        np.testing.assert_array_equal(np.asarray(getattr(layer, field)), raw[f"model.layers.1.{name}.weight"] + 1)
    np.testing.assert_array_equal(np.asarray(params.final_norm), raw["model.norm.weight"] + 1)


def test_quantize_q4_k_falls_back_where_rows_do_not_fit():
    directory = oracle_random_qwen2(seed=6, hidden=256, intermediate=320, heads=4, kv_heads=2)
    cfg, dense = load_hf_dir(directory, progress=False)
    qcfg, quant = load_hf_dir(directory, progress=False, quantize="q4_k")
    layer = quant.layers[0]
    # rows of 256 take Q4_K; w_down's rows of 320 split into 32-blocks only: Q5_0
    assert {layer.wq.qtype.name, layer.w_gate.qtype.name, quant.embed.qtype.name} == {"Q4_K"}
    assert layer.w_down.qtype.name == "Q5_0"
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        w, q = np.asarray(getattr(dense.layers[1], name)), np.asarray(dequantize(getattr(quant.layers[1], name)))
        # quantize's documented bound for Gaussian weights (measured 4-7% here)
        assert np.sqrt(np.mean((q - w) ** 2) / np.mean(w * w)) < 0.09, name
    ids = [np.random.default_rng(2).integers(0, cfg.vocab_size, n).tolist() for n in (6, 20)]
    err = relative_error(_prefill_logits(qcfg, quant, ids), _prefill_logits(cfg, dense, ids))
    # the random model's logits are small (max 1.4), so 4-bit weights move them a lot relatively:
    # measured 0.107 (Q4_0 everywhere: 0.18, Q8_0: 0.008)
    assert err < 0.15, err


# --- bad input ------------------------------------------------------------------------------------------


@pytest.fixture
def ckpt(qwen2_dir, tmp_path):
    """A writable copy of the small untied Qwen2 checkpoint."""
    for name in ("config.json", "model.safetensors"):
        shutil.copy(qwen2_dir / name, tmp_path / name)
    return tmp_path


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _edit_tensors(directory, fn):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def test_ckpt_copy_loads(ckpt):
    cfg, _ = load_hf_dir(ckpt, progress=False)
    assert cfg.arch == "qwen2" and not cfg.tie_embeddings


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=...), r"missing config key 'hidden_size'"),
    (dict(num_hidden_layers="two"), r"config key 'num_hidden_layers' = 'two' is not an integer"),
    (dict(num_attention_heads=0), r"config key 'num_attention_heads' = 0 is not an integer >= 1"),
    (dict(rms_norm_eps=-1), r"config key 'rms_norm_eps' = -1 is not a positive number"),
    (dict(model_type="gpt2"), r"unsupported model_type 'gpt2'; supported: llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, phi3, gemma3_text, gemma3"),
    (dict(model_type=...), r"unsupported model_type None"),
    (dict(final_logit_softcapping=30.0), r"final_logit_softcapping = 30.0 is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     r"rope type 'yarn' is not supported here; supported: default, linear, llama3"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), r"linear rope scaling lacks 'factor'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
     r"llama3 rope scaling lacks 'low_freq_factor'"),
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor 0.5 is not supported"),
    (dict(hidden_act="relu"), r"hidden_act 'relu' is not supported"),
    (dict(num_experts=8), r"num_experts = 8: mixture-of-experts layers are not supported for model_type 'qwen2'"),
    (dict(model_type="deepseek_v3"), r"unsupported model_type 'deepseek_v3'"),
    (dict(num_key_value_heads=3), r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (dict(intermediate_size=96), r"tensor 'model\.layers\.\d\.mlp\.(down|gate|up)_proj\.weight' has shape \[.*\], "
                                 r"but config\.json implies \[.*96.*\]"),
    (dict(tie_word_embeddings=True, vocab_size=300), r"tensor '(model\.embed_tokens|lm_head)\.weight' has shape \[279, 64\], "
                                                    r"but config\.json implies \[300, 64\]"),
    (dict(layer_types=["full_attention"]), r"layer_types must list"),
])
def test_bad_config_is_a_clear_error(ckpt, changes, message):
    _edit_config(ckpt, **changes)
    with pytest.raises(ModelFileError, match=message):
        load_hf_dir(ckpt, progress=False)


def test_gemma3_without_text_config_is_an_error(ckpt):
    _edit_config(ckpt, model_type="gemma3")
    with pytest.raises(ModelFileError, match="model_type 'gemma3' needs a 'text_config' object"):
        load_hf_dir(ckpt, progress=False)


def test_missing_or_broken_config_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match=r"config\.json: not valid JSON"):
        load_hf_dir(ckpt, progress=False)
    (ckpt / "config.json").unlink()
    with pytest.raises(ModelFileError, match=r"no config\.json"):
        load_hf_dir(ckpt, progress=False)
    with pytest.raises(ModelFileError, match="is not a directory"):
        load_hf_dir(ckpt / "model.safetensors", progress=False)


def test_missing_tensor_is_named(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ModelFileError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_hf_dir(ckpt, progress=False)


def test_missing_untied_head_is_named(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelFileError, match=r"missing tensors: lm_head\.weight \(tie_word_embeddings is false\)"):
        load_hf_dir(ckpt, progress=False)


def test_tensor_without_a_place_is_named(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}))
    with pytest.raises(ModelFileError, match=r"no place for: model\.layers\.0\.self_attn\.o_proj\.bias"):
        load_hf_dir(ckpt, progress=False)


def test_unsupported_tensor_dtype_is_named(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.float64)}))
    with pytest.raises(ModelFileError, match=r"tensor 'model\.norm\.weight' has dtype F64; supported: BF16, F16, F32"):
        load_hf_dir(ckpt, progress=False)


def test_missing_weight_files(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    with pytest.raises(ModelFileError, match=r"no weights: expected model\.safetensors or model\.safetensors\.index\.json"):
        load_hf_dir(ckpt, progress=False)
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFileError, match=r"lists weight files that are missing: model-00002-of-00002\.safetensors"):
        load_hf_dir(ckpt, progress=False)
    (ckpt / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ModelFileError, match=r"not a safetensors index"):
        load_hf_dir(ckpt, progress=False)


def test_corrupt_weight_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    with pytest.raises(ModelFileError, match=r"model\.safetensors: cannot read the safetensors header"):
        load_hf_dir(ckpt, progress=False)


def test_unknown_quantize_type(ckpt):
    with pytest.raises(ValueError, match=r"quantize='q3_k' is not supported; supported: q8_0, q4_0"):
        load_hf_dir(ckpt, progress=False, quantize="q3_k")
