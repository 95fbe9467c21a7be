"""Every architecture switch of the forward pass against transformers (the oracle), on models the
oracle builds or reads: the real Gemma 3 GGUF (sliding windows, a prompt longer than the window),
and tiny random checkpoints made by transformers — Qwen2 (biases, tied and untied heads), Qwen3
(per-head q/k norms), Phi-3 (stacked qkv and gate/up, LongRoPE, a sliding window), Llama with
Llama-3 rope scaling, Mistral with and without a sliding window, Gemma 3 with a small window,
linear rope scaling on its global layers and query_pre_attn_scalar != head_dim — each loaded from
its directory and from the GGUF llama.cpp's own convert_hf_to_gguf.py makes of it.

Tolerance: max|Δ| <= 1e-4·max|logit| (1e-3 for the real model) after prefill and after each
teacher-forced decode step; greedy continuations identical.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from rjax.loading.loaders.gguf import ModelFileError, config_from_metadata, load_gguf
from rjax.loading.loaders.hf_config import config_from_hf
from rjax.loading.loaders.safetensors import load_hf_dir
from tests.compare import check_against_oracle
from tests.oracle.client import oracle_logits, oracle_random_model, oracle_random_qwen2, oracle_to_gguf, oracle_tokenize

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


# --- random models from the oracle, from their directories and as llama.cpp converts them ----------

RTOL = 1e-4  # of the largest logit; float32 on both sides


def _random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _check(directory, source: str, lengths, max_len=256):
    """The checkpoint `directory` loaded from itself ("hf") or from the GGUF llama.cpp's own
    converter makes of it ("gguf"), against transformers on the directory. -> (config, error)."""
    if source == "hf":
        cfg, params = load_hf_dir(directory, progress=False)
    else:
        cfg, params, _ = load_gguf(oracle_to_gguf(directory), progress=False)
    ids = _random_prompts(cfg.vocab_size, lengths)
    ref = oracle_logits(directory, ids, DECODE_STEPS, greedy_tokens=GREEDY)
    return cfg, check_against_oracle(cfg, params, ids, ref, max_len=max_len, decode_steps=DECODE_STEPS,
                                     greedy=GREEDY, rtol=RTOL)


SOURCES = pytest.mark.parametrize("source", ["hf", "gguf"])


@pytest.mark.oracle
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_random_qwen2_matches_transformers(tied):
    directory = oracle_random_qwen2(seed=3, tie_word_embeddings=tied)
    cfg, err = _check(directory, "hf", [7, 19, 40])
    assert cfg.arch == "qwen2" and cfg.qkv_bias and cfg.tie_embeddings == tied
    print(f"random qwen2 ({'tied' if tied else 'untied'}): max relative logit error {err:.2e}")


@pytest.mark.oracle
def test_qwen2_gguf_matches_transformers():
    cfg, err = _check(oracle_random_qwen2(seed=3, tie_word_embeddings=False), "gguf", [7, 19, 40])
    assert cfg.qkv_bias and cfg.rope_pairing == "halves" and not cfg.tie_embeddings
    print(f"random qwen2 as GGUF: max relative logit error {err:.2e}")


@pytest.mark.oracle
@SOURCES
def test_qwen3_matches_transformers(source):
    directory = oracle_random_model("qwen3", seed=17, tie_word_embeddings=False)
    cfg, err = _check(directory, source, [7, 19, 40])
    assert cfg.arch == "qwen3" and cfg.qk_norm and not cfg.qkv_bias and not cfg.post_norms
    print(f"random qwen3 from {source}: max relative logit error {err:.2e}")


PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                 "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]}


@pytest.mark.oracle
@SOURCES
def test_phi3_longrope_sliding_window_matches_transformers(source):
    # stretched 4x past an original context of 64: the short factors hold, and the attention factor
    # sqrt(1 + ln 4 / ln 64) scales every score; a window of 16 on every layer
    directory = oracle_random_model("phi3", seed=19, tie_word_embeddings=False, max_position_embeddings=256,
                                    original_max_position_embeddings=64, rope_parameters=PHI3_LONGROPE,
                                    sliding_window=16)
    cfg, err = _check(directory, source, [5, 13, 28], max_len=64)
    assert cfg.arch == "phi3" and cfg.context_length == 64 and cfg.layer_windows == (16, 16)
    assert cfg.rope_freq_factors == pytest.approx(PHI3_LONGROPE["short_factor"])
    assert cfg.attn_scale == pytest.approx((1 + math.log(4) / math.log(64)) / 4)
    print(f"random phi3 from {source}, longrope, window 16: max relative logit error {err:.2e}")


@pytest.mark.oracle
@SOURCES
def test_qwen3_moe_matches_transformers(source):
    # 4 experts of 32, 2 per token, renormalized: every token's choice and weights matter
    directory = oracle_random_model("qwen3_moe", seed=23, tie_word_embeddings=False, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    cfg, err = _check(directory, source, [7, 19, 40])
    assert (cfg.arch, cfg.n_experts, cfg.n_experts_used, cfg.expert_d_ff, cfg.expert_norm) == ("qwen3", 4, 2, 32, True)
    print(f"random qwen3_moe from {source}: max relative logit error {err:.2e}")


@pytest.mark.oracle
@SOURCES
def test_mixtral_matches_transformers(source):
    directory = oracle_random_model("mixtral", seed=29, tie_word_embeddings=False, num_local_experts=4,
                                    num_experts_per_tok=2)
    cfg, err = _check(directory, source, [7, 19, 40])
    assert (cfg.arch, cfg.n_experts, cfg.n_experts_used, cfg.expert_d_ff) == ("llama", 4, 2, 128)
    print(f"random mixtral from {source}: max relative logit error {err:.2e}")


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.oracle
@SOURCES
def test_llama3_rope_scaling_matches_transformers(source):
    # original context 64 with head_dim 16: of the 8 frequencies one is kept, two are blended and
    # five are stretched, so every branch of the scaling matters; a GGUF stores the scaling as
    # llama.cpp's per-frequency divisors (`rope_freqs`) and its Q/K rows for adjacent-pair rope
    directory = oracle_random_model("llama", seed=5, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)
    cfg, err = _check(directory, source, [9, 70, 150])
    if source == "hf":
        assert cfg.rope_scaling is not None and cfg.rope_scaling.original_context_length == 64
    else:
        assert cfg.rope_pairing == "pairs" and cfg.rope_scaling is None and len(cfg.rope_freq_factors) == 8
    print(f"random llama from {source}, llama3 rope scaling: max relative logit error {err:.2e}")


@pytest.mark.oracle
def test_mistral_sliding_window_matches_transformers():
    directory = oracle_random_model("mistral", seed=7, sliding_window=8)
    cfg, err = _check(directory, "hf", [5, 13, 30])
    assert cfg.layer_windows == (8, 8)
    print(f"random mistral, sliding window 8: max relative logit error {err:.2e}")


@pytest.mark.oracle
def test_mistral_gguf_matches_transformers():
    # llama.cpp's converter writes Mistral as llama and drops its sliding window (as llama.cpp runs it),
    # so the GGUF is checked on a Mistral without one, as Mistral 7B v0.2 on are
    directory = oracle_random_model("mistral", seed=7, sliding_window=None, tie_word_embeddings=False)
    cfg, err = _check(directory, "gguf", [5, 13, 30])
    assert cfg.arch == "llama" and cfg.layer_windows == (None, None)
    print(f"random mistral as GGUF: max relative logit error {err:.2e}")


@pytest.mark.oracle
def test_gemma3_text_local_global_linear_rope_matches_transformers():
    directory = oracle_random_model(
        "gemma3_text", seed=11, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    cfg, err = _check(directory, "hf", [6, 17, 33])
    assert cfg.layer_windows == (8, 8, None) and cfg.layer_rope_linear == (1.0, 1.0, 4.0)
    assert cfg.attn_scale == pytest.approx(24 ** -0.5)
    print(f"random gemma3_text, window 8, linear rope x4 on global layers: max relative logit error {err:.2e}")


@pytest.mark.oracle
def test_gemma3_gguf_pattern_local_base_and_linear_rope_match_transformers():
    # GGUF has no query_pre_attn_scalar (llama.cpp scales by head_dim, so the model uses that) and
    # llama.cpp's converter writes no layer pattern (llama.cpp runs Gemma 3's five local layers, then
    # one global): six layers in that pattern
    directory = oracle_random_model(
        "gemma3_text", seed=13, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0}})
    cfg, err = _check(directory, "gguf", [6, 17, 33])
    assert cfg.layer_windows == (8,) * 5 + (None,) and cfg.layer_rope_theta == (2e4,) * 5 + (1e6,)
    assert cfg.layer_rope_linear == (1.0,) * 5 + (4.0,)
    print(f"random gemma3 as GGUF (local base 2e4, linear x4): max relative logit error {err:.2e}")


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


@pytest.mark.parametrize("arch, drop, extra, message", [
    ("qwen3", "qwen3.attention.head_count", {}, r"missing metadata key 'qwen3\.attention\.head_count'"),
    ("phi3", "phi3.embedding_length", {}, r"missing metadata key 'phi3\.embedding_length'"),
    ("llama", None, {"llama.expert_count": 4, "llama.expert_used_count": 5},
     r"metadata key 'llama\.expert_used_count' = 5 is not an integer in \[1, 4\]"),
    ("qwen3moe", None, {}, r"missing metadata key 'qwen3moe\.expert_count' \(a qwen3moe model has experts\)"),
    ("deepseek2", None, {}, r"unsupported architecture 'deepseek2' \(general\.architecture\); supported: llama, "
                            r"qwen2, qwen3, phi3, gemma3, qwen3moe"),
])
def test_gguf_bad_or_unsupported_architecture_fields_are_named(arch, drop, extra, message):
    meta = {f"{arch}.{k}": v for k, v in {
        "block_count": 2, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
        "attention.head_count_kv": 2, "context_length": 256, "attention.layer_norm_rms_epsilon": 1e-6}.items()}
    meta = {"general.architecture": arch, **meta, **extra}
    meta.pop(drop, None)
    with pytest.raises(ModelFileError, match=message):
        config_from_metadata(meta, "x.gguf")


def _hf(model_type, **changes):
    hf = dict(model_type=model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
    hf.update(changes)
    return {k: v for k, v in hf.items() if v is not ...}


@pytest.mark.parametrize("model_type, changes, message", [
    ("qwen3", dict(num_attention_heads=...), r"missing config key 'num_attention_heads'"),
    ("qwen3", dict(attention_bias=True), r"attention_bias .* is not supported for model_type 'qwen3'"),
    ("phi3", dict(num_local_experts=16), r"num_local_experts = 16: mixture-of-experts layers are not supported"),
    ("phi3", dict(rope_scaling={"type": "su", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}),
     r"longrope rope scaling needs 'short_factor': 8 positive numbers \(head_dim 16 / 2\), got \[1\.0, 1\.0, 1\.0\]"),
    ("phi3", dict(partial_rotary_factor=0.75), r"partial_rotary_factor 0\.75 is not supported"),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=5),
     r"num_experts_per_tok = 5 is more than num_local_experts = 4"),
    ("mixtral", dict(num_local_experts=0), r"config key 'num_local_experts' = 0 is not an integer >= 1"),
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=0),
     r"config key 'moe_intermediate_size' = 0 is not an integer >= 1"),
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0]),
     r"mlp_only_layers = \[0\] .*: dense layers among the expert layers are not supported"),
])
def test_hf_bad_fields_of_new_architectures_are_named(model_type, changes, message):
    with pytest.raises(ModelFileError, match=message):
        config_from_hf(model_type, _hf(model_type, **changes), "x/config.json")


def test_hf_phi3_longrope_with_equal_factors_keeps_the_whole_context():
    factors = [1.0 + i / 8 for i in range(8)]
    cfg = config_from_hf("phi3", _hf("phi3", max_position_embeddings=4096, original_max_position_embeddings=1024,
                                      rope_scaling={"type": "su", "short_factor": factors, "long_factor": factors}))
    assert cfg.context_length == 4096 and cfg.rope_freq_factors == tuple(factors)
    assert cfg.attn_scale == pytest.approx((1 + math.log(4) / math.log(1024)) / 4)


def test_gguf_router_without_experts_is_named(tmp_path):
    import gguf

    path = tmp_path / "router.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for method, value in [("add_block_count", 1), ("add_embedding_length", 32), ("add_feed_forward_length", 64),
                          ("add_head_count", 2), ("add_context_length", 64), ("add_layer_norm_rms_eps", 1e-6)]:
        getattr(w, method)(value)
    w.add_tensor("token_embd.weight", np.ones((16, 32), np.float32))
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"tensor 'blk\.0\.ffn_gate_inp\.weight' belongs to a mixture of "
                                             r"experts, but the file has no llama\.expert_count"):
        load_gguf(path, progress=False)


def test_gguf_expert_tensor_of_another_expert_count_is_named(tmp_path):
    import gguf

    path = tmp_path / "experts.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for method, value in [("add_block_count", 1), ("add_embedding_length", 32), ("add_feed_forward_length", 64),
                          ("add_head_count", 2), ("add_context_length", 64), ("add_layer_norm_rms_eps", 1e-6),
                          ("add_expert_count", 4), ("add_expert_used_count", 2), ("add_expert_feed_forward_length", 16)]:
        getattr(w, method)(value)
    w.add_tensor("token_embd.weight", np.ones((16, 32), np.float32))
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.ones((4, 32), np.float32))
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.ones((3, 16, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \[3, 16, 32\], but the "
                                             r"metadata implies \[4, 16, 32\] \(embedding 32, 4 experts of feed-forward "
                                             r"16 \(llama\.expert_count, llama\.expert_feed_forward_length\)"):
        load_gguf(path, progress=False)
