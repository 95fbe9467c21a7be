"""Every architecture switch of the forward pass against transformers (the oracle), on models the
oracle builds or reads: the real Gemma 3 GGUF (sliding windows, a prompt longer than the window),
random Qwen2 (biases, tied and untied heads), random Llama with Llama-3 rope scaling (from a
safetensors checkpoint, and from a GGUF that stores the scaling as llama.cpp's `rope_freqs`),
random Mistral with a sliding window on every layer, and random Gemma 3 with a small window,
linear rope scaling on its global layers and query_pre_attn_scalar != head_dim.

Tolerance: max|Δ| <= 1e-3·max|logit| after prefill and after each teacher-forced decode step;
greedy continuations identical.
"""
from __future__ import annotations

import json
import math

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from rjax.loaders.gguf import ModelFileError, config_from_metadata, load_gguf
from rjax.loaders.safetensors import load_hf_dir
from tests.compare import check_against_oracle
from tests.oracle.client import oracle_logits, oracle_random_model, oracle_random_qwen2, oracle_tokenize

DECODE_STEPS = 16
GREEDY = 32

# --- Gemma 3 270M, GGUF ------------------------------------------------------------------------

SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "Translate to German: The weather is nice today.",
]
# Longer than gemma3's 512-token sliding window, so local layers must drop early keys.
LONG_PROMPT = " ".join(
    f"Entry {i}: the {w} {a} walked {i * 3} miles to the {p} and counted {i * 11} stones before noon."
    for i, (w, a, p) in enumerate(zip(
        ["quick", "brown", "red", "sly", "old", "young", "grey", "tiny", "giant", "swift"] * 4,
        ["fox", "bear", "crow", "hare", "wolf", "deer", "owl", "mole"] * 5,
        ["river", "mill", "harbour", "forest", "tower"] * 8)) if i < 28)


@pytest.fixture(scope="module")
def gemma3_gguf(gemma3_path):
    ids = oracle_tokenize(gemma3_path, SHORT_PROMPTS + [LONG_PROMPT])["ids_with_special"]
    ref = oracle_logits(gemma3_path, ids, DECODE_STEPS, greedy_tokens=GREEDY)
    cfg, params, _ = load_gguf(gemma3_path, progress=False)
    return ids, ref, cfg, params


@pytest.mark.slow
@pytest.mark.oracle
def test_gemma3_gguf_matches_transformers_past_the_sliding_window(gemma3_gguf):
    ids, ref, cfg, params = gemma3_gguf
    window = max(w for w in cfg.layer_windows if w)
    assert window == 512 and 600 <= len(ids[-1]) <= 1024 - DECODE_STEPS - GREEDY, len(ids[-1])
    # the short prompts share one bucket; the long one is prefilled alone into the same cache
    err = check_against_oracle(cfg, params, ids, ref, max_len=768, decode_steps=DECODE_STEPS, greedy=GREEDY,
                               groups=[[0, 1, 2, 3], [4]])
    print(f"gemma3-270m GGUF: max relative logit error {err:.2e} (prompts of {[len(p) for p in ids]} tokens)")


# --- random models from the oracle ---------------------------------------------------------------


def _random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _check_dir(directory, lengths, max_len=256, seed=0):
    cfg, params = load_hf_dir(directory, progress=False)
    ids = _random_prompts(cfg.vocab_size, lengths, seed)
    ref = oracle_logits(directory, ids, DECODE_STEPS, greedy_tokens=GREEDY)
    return cfg, check_against_oracle(cfg, params, ids, ref, max_len=max_len, decode_steps=DECODE_STEPS,
                                     greedy=GREEDY)


@pytest.mark.oracle
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_random_qwen2_matches_transformers(tied):
    directory = oracle_random_qwen2(seed=3, tie_word_embeddings=tied)
    cfg, err = _check_dir(directory, [7, 19, 40])
    assert cfg.arch == "qwen2" and cfg.qkv_bias and cfg.tie_embeddings == tied
    print(f"random qwen2 ({'tied' if tied else 'untied'}): max relative logit error {err:.2e}")


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def llama3_dir():
    # original context 64 with head_dim 16: of the 8 frequencies one is kept, two are blended and
    # five are stretched, so every branch of the scaling matters
    return oracle_random_model("llama", seed=5, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)


@pytest.mark.oracle
def test_llama3_rope_scaling_matches_transformers(llama3_dir):
    cfg, err = _check_dir(llama3_dir, [9, 70, 150])
    assert cfg.rope_scaling is not None and cfg.rope_scaling.original_context_length == 64
    print(f"random llama, llama3 rope scaling: max relative logit error {err:.2e}")


@pytest.mark.oracle
def test_mistral_sliding_window_matches_transformers():
    directory = oracle_random_model("mistral", seed=7, sliding_window=8)
    cfg, err = _check_dir(directory, [5, 13, 30])
    assert cfg.layer_windows == (8, 8)
    print(f"random mistral, sliding window 8: max relative logit error {err:.2e}")


@pytest.mark.oracle
def test_gemma3_text_local_global_linear_rope_matches_transformers():
    directory = oracle_random_model(
        "gemma3_text", seed=11, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    cfg, err = _check_dir(directory, [6, 17, 33])
    assert cfg.layer_windows == (8, 8, None) and cfg.layer_rope_linear == (1.0, 1.0, 4.0)
    assert cfg.attn_scale == pytest.approx(24 ** -0.5)
    print(f"random gemma3_text, window 8, linear rope x4 on global layers: max relative logit error {err:.2e}")


# --- GGUF: Llama-3 scaling as llama.cpp stores it --------------------------------------------------


def _llama3_freq_factors(head_dim: int, rope: dict) -> np.ndarray:
    """llama.cpp's converter: per-frequency divisors for Llama-3 scaling (1 = unchanged)."""
    inv = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    ctx, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                              rope["high_freq_factor"], rope["factor"])
    out = []
    for freq in inv:
        wavelen = 2 * math.pi / freq
        if wavelen < ctx / high:
            out.append(1.0)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _to_pairs(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a Q/K projection reordered from rotate-halves to adjacent-pair rotation, as llama
    GGUFs store them."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_NORM_NAMES = {  # the norm around the MLP is named differently in llama-style and gemma models
    "llama": {"post_attention_layernorm.weight": "ffn_norm.weight"},
    "qwen2": {"post_attention_layernorm.weight": "ffn_norm.weight"},
    "gemma3": {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
}


def _write_gguf(directory, out_path, arch: str, metadata=(), tensors=()):
    """A checkpoint directory as llama.cpp's converter would write it (float32): tensor names, Q/K
    rows reordered for llama's adjacent-pair rope, gemma norm weights with their +1 folded in.
    `metadata`: extra (writer method, value) pairs; `tensors`: extra (name, array) pairs."""
    hf = json.loads((directory / "config.json").read_text())
    w = load_file(directory / "model.safetensors")
    n_heads, n_kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim") or hf["hidden_size"] // n_heads
    rope = hf["rope_parameters"]
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_vocab_size(hf["vocab_size"])
    for method, value in metadata:
        getattr(writer, method)(value)
    for name, value in tensors:
        writer.add_tensor(name, value)
    plus = 1.0 if arch == "gemma3" else 0.0
    writer.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", w["model.norm.weight"] + plus)
    if not hf["tie_word_embeddings"]:
        writer.add_tensor("output.weight", w["lm_head.weight"])
    names = {**_GGUF_LAYER_NAMES, **_GGUF_NORM_NAMES[arch]}
    for i in range(hf["num_hidden_layers"]):
        for src, dst in names.items():
            t = w.get(f"model.layers.{i}.{src}")
            if t is None:
                continue
            if arch == "llama" and dst == "attn_q.weight":
                t = _to_pairs(t, n_heads)
            elif arch == "llama" and dst == "attn_k.weight":
                t = _to_pairs(t, n_kv)
            elif "norm" in dst:
                t = t + plus
            writer.add_tensor(f"blk.{i}.{dst}", t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _check_gguf_against_dir(gguf_path, directory, lengths):
    cfg, params, _ = load_gguf(gguf_path, progress=False)
    ids = _random_prompts(cfg.vocab_size, lengths)
    ref = oracle_logits(directory, ids, DECODE_STEPS, greedy_tokens=GREEDY)
    return cfg, check_against_oracle(cfg, params, ids, ref, max_len=256, decode_steps=DECODE_STEPS, greedy=GREEDY)


@pytest.mark.oracle
def test_llama3_gguf_rope_freqs_matches_transformers(llama3_dir, tmp_path):
    path = tmp_path / "llama3-random.gguf"
    _write_gguf(llama3_dir, path, "llama", tensors=[("rope_freqs.weight", _llama3_freq_factors(16, LLAMA3_ROPE))])
    cfg, err = _check_gguf_against_dir(path, llama3_dir, [9, 70, 150])
    assert cfg.rope_pairing == "pairs" and cfg.rope_scaling is None and len(cfg.rope_freq_factors) == 8
    print(f"random llama as GGUF with rope_freqs: max relative logit error {err:.2e}")


@pytest.mark.oracle
def test_qwen2_gguf_matches_transformers(tmp_path):
    directory = oracle_random_qwen2(seed=3, tie_word_embeddings=False)
    path = tmp_path / "qwen2-random.gguf"
    _write_gguf(directory, path, "qwen2")
    cfg, err = _check_gguf_against_dir(path, directory, [7, 19, 40])
    assert cfg.qkv_bias and cfg.rope_pairing == "halves" and not cfg.tie_embeddings
    print(f"random qwen2 as GGUF: max relative logit error {err:.2e}")


@pytest.mark.oracle
def test_gemma3_gguf_pattern_local_base_and_linear_rope_match_transformers(tmp_path):
    # GGUF has no query_pre_attn_scalar: llama.cpp scales by head_dim, so the model uses that
    directory = oracle_random_model(
        "gemma3_text", seed=13, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0}})
    path = tmp_path / "gemma3-random.gguf"
    _write_gguf(directory, path, "gemma3", metadata=[
        ("add_sliding_window", 8), ("add_sliding_window_pattern", 3), ("add_rope_freq_base_swa", 20_000.0),
        ("add_rope_scaling_type", gguf.RopeScalingType.LINEAR), ("add_rope_scaling_factor", 4.0)])
    cfg, err = _check_gguf_against_dir(path, directory, [6, 17, 33])
    assert cfg.layer_windows == (8, 8, None) and cfg.layer_rope_theta == (2e4, 2e4, 1e6)
    assert cfg.layer_rope_linear == (1.0, 1.0, 4.0)
    print(f"random gemma3 as GGUF (pattern 3, local base 2e4, linear x4): max relative logit error {err:.2e}")


# --- GGUF metadata -> config ----------------------------------------------------------------------


def _gemma3_meta(**extra):
    meta = {"general.architecture": "gemma3", "gemma3.block_count": 12, "gemma3.embedding_length": 256,
            "gemma3.feed_forward_length": 512, "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 2,
            "gemma3.attention.key_length": 64, "gemma3.context_length": 4096, "gemma3.rope.freq_base": 1e6,
            "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.attention.sliding_window": 512,
            "gemma3.vocab_size": 1000}
    meta.update(extra)
    return meta


def test_gguf_gemma3_linear_rope_scaling_applies_to_global_layers_only():
    cfg = config_from_metadata(_gemma3_meta(**{"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}))
    assert cfg.layer_rope_linear == (1.0,) * 5 + (8.0,) + (1.0,) * 5 + (8.0,)
    assert cfg.layer_rope_theta == (1e4,) * 5 + (1e6,) + (1e4,) * 5 + (1e6,)
    assert cfg.layer_windows == (512,) * 5 + (None,) + (512,) * 5 + (None,)
    assert cfg.attn_scale == pytest.approx(64 ** -0.5)


def test_gguf_gemma3_27b_scales_queries_by_hidden_over_heads():
    cfg = config_from_metadata(_gemma3_meta(**{"gemma3.block_count": 62, "gemma3.embedding_length": 5376,
                                               "gemma3.attention.head_count": 32, "gemma3.attention.head_count_kv": 16,
                                               "gemma3.attention.key_length": 128}))
    assert cfg.attn_scale == pytest.approx(168 ** -0.5)


def test_gguf_unsupported_rope_scaling_type_is_an_error():
    with pytest.raises(ModelFileError, match="rope scaling type 'yarn'.*supported: none, linear, llama3"):
        config_from_metadata(_gemma3_meta(**{"gemma3.rope.scaling.type": "yarn"}), "x.gguf")


def test_gguf_gemma3_per_layer_sliding_window_flags():
    flags = [True, True, False] * 4  # true: a sliding-window layer
    cfg = config_from_metadata(_gemma3_meta(**{"gemma3.attention.sliding_window_pattern": flags}))
    assert cfg.layer_windows == (512, 512, None) * 4
    with pytest.raises(ModelFileError, match="sliding_window_pattern has 3 entries for 12 layers"):
        config_from_metadata(_gemma3_meta(**{"gemma3.attention.sliding_window_pattern": flags[:3]}), "x.gguf")
