"""Synthetic GGUF models: file structure read back by gguf's reader, block statistics checked
with gguf's own dequantizer, and small files run through the rjax engine."""
import hashlib
import math
import time

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as QType

from rjax.engine import steps as engine
from rjax.loading.loaders.gguf import load_gguf
from rjax.math.cache import init_cache
from gguf_blocks import formats
from rjax.loading.synth import (MATRIX, MIXES, SHAPES, SynthError, TensorSpec, more_bits_layer, random_tensor,
                                tensor_specs, write_synthetic)

SMALL_VOCAB = 1024  # >= the built-in tokenizer's 258 tokens; keeps the LM head small on CPU


def _field(reader, key):
    return reader.fields[key].contents()


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def smollm2_q4_1(tmp_path_factory):
    """The default model's shape and mix, 2 blocks, full vocabulary."""
    path = tmp_path_factory.mktemp("synth") / "smollm2-q4_1.gguf"
    return write_synthetic(path, "smollm2-135m", "q4_1", seed=0, n_layers=2, tokenizer_from="builtin")


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_q4_1):
    return GGUFReader(smollm2_q4_1)  # parsing 49,152 token strings takes seconds: once


def test_file_reads_back_with_specified_types_and_shapes(smollm2_reader):
    r = smollm2_reader
    assert _field(r, "general.architecture") == "llama"
    assert _field(r, "llama.block_count") == 2
    assert _field(r, "llama.embedding_length") == 576
    assert _field(r, "llama.feed_forward_length") == 1536
    assert _field(r, "llama.attention.head_count") == 9
    assert _field(r, "llama.attention.head_count_kv") == 3
    assert _field(r, "llama.vocab_size") == 49152
    assert _field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_1
    assert len(_field(r, "tokenizer.ggml.tokens")) == 49152
    tensors = {t.name: (t.tensor_type, [int(x) for x in t.shape]) for t in r.tensors}
    # GGUF shapes are (in, out): ne[0] is the row length.
    expected = {"token_embd.weight": (QType.Q8_0, [576, 49152]), "output_norm.weight": (QType.F32, [576])}
    for i in range(2):
        expected.update({
            f"blk.{i}.attn_norm.weight": (QType.F32, [576]), f"blk.{i}.ffn_norm.weight": (QType.F32, [576]),
            f"blk.{i}.attn_q.weight": (QType.Q4_1, [576, 576]), f"blk.{i}.attn_k.weight": (QType.Q4_1, [576, 192]),
            f"blk.{i}.attn_v.weight": (QType.Q4_1, [576, 192]),
            f"blk.{i}.attn_output.weight": (QType.Q4_1, [576, 576]),
            f"blk.{i}.ffn_gate.weight": (QType.Q4_1, [576, 1536]), f"blk.{i}.ffn_up.weight": (QType.Q4_1, [576, 1536]),
            f"blk.{i}.ffn_down.weight": (QType.Q4_1, [1536, 576]),
        })
    assert tensors == expected
    # Same tensor bytes as the real default model (98,362,432 bytes for 30 blocks) per block.
    for t in r.tensors:
        assert int(t.n_bytes) == formats.tensor_nbytes(t.tensor_type, tuple(reversed(t.shape.tolist())))


def test_every_tensor_dequantizes_finite_with_the_planned_scale(smollm2_reader):
    for t in smollm2_reader.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        assert np.isfinite(x).all(), t.name
        if t.name.endswith("norm.weight"):
            np.testing.assert_array_equal(x, 1.0)
            continue
        row_len = int(t.shape[0])
        rms = math.sqrt(float(np.mean(x * x)))
        assert abs(rms * math.sqrt(row_len) - 1.0) < 0.1, (t.name, rms)
        assert abs(x.mean()) < 0.05 * rms, (t.name, x.mean(), rms)


@pytest.mark.parametrize("qtype", sorted(formats.LAYOUTS) + [QType.F16], ids=lambda t: t.name)
def test_random_blocks_of_every_type(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    row_len = 2 * 256
    spec = TensorSpec("w", (96, row_len), qtype, MATRIX)
    data = random_tensor(spec, seed=3, index=0)
    assert data.nbytes == spec.nbytes == 96 * row_len // block * GGML_QUANT_SIZES[qtype][1]
    x = gguf.quants.dequantize(data, qtype).astype(np.float64) if qtype in formats.LAYOUTS else data.astype(np.float64)
    assert x.shape == (96, row_len)
    assert np.isfinite(x).all()
    rms = math.sqrt(float(np.mean(x * x)))
    assert abs(rms * math.sqrt(row_len) - 1.0) < 0.15, rms
    # Types with an offset field (dmin, m) are centred; the others keep their grid's own
    # asymmetry (Q4_0 quants -8..7 average -0.5, about a tenth of their RMS).
    assert abs(x.mean()) < 0.15 * rms
    # the same (seed, index) gives the same bytes; another index, others
    np.testing.assert_array_equal(random_tensor(spec, seed=3, index=0), data)
    assert not np.array_equal(random_tensor(spec, seed=3, index=1), data)


def test_quant_mixes_and_k_quant_fallbacks():
    def types(shape, mix):
        return {s.name: s.qtype for s in tensor_specs(SHAPES[shape], MIXES[mix], n_layers=1)}

    # llama-8b: untied, every row a multiple of 256
    t = types("llama-8b", "q4_k")
    assert t["token_embd.weight"] == QType.Q4_K and t["output.weight"] == QType.Q6_K
    assert {v for k, v in t.items() if k.startswith("blk.") and not k.endswith("norm.weight")} == {QType.Q4_K}
    # llama-1b: tied, so the embedding is the Q6_K output
    t = types("llama-1b", "q4_k")
    assert t["token_embd.weight"] == QType.Q6_K and "output.weight" not in t
    # smollm2: rows of 576 cannot be K-quants: Q4_K -> Q5_0, Q6_K -> Q8_0 (as llama.cpp)
    t = types("smollm2-135m", "q4_k")
    assert t["token_embd.weight"] == QType.Q8_0
    assert t["blk.0.attn_q.weight"] == QType.Q5_0 and t["blk.0.ffn_down.weight"] == QType.Q4_K
    # gemma3: 1152-wide inputs fall back, the 1024-wide attention output and 6912-wide FFN input do not
    t = types("gemma3-1b", "q4_k")
    assert t["blk.0.attn_q.weight"] == QType.Q5_0 and t["blk.0.attn_output.weight"] == QType.Q4_K
    assert t["blk.0.ffn_down.weight"] == QType.Q4_K and t["blk.0.attn_q_norm.weight"] == QType.F32
    # qwen2 has q/k/v biases
    t = types("qwen2.5-1.5b", "q8_0")
    assert t["blk.0.attn_q.bias"] == QType.F32 and t["blk.0.attn_v.bias"] == QType.F32
    assert set(types("llama-1b", "q4_1").values()) == {QType.Q4_1, QType.Q8_0, QType.F32}
    assert set(types("llama-1b", "q4_0").values()) == {QType.Q4_0, QType.Q6_K, QType.F32}
    assert set(types("llama-1b", "f16").values()) == {QType.F16, QType.F32}


def test_q4_k_m_gives_more_bits_where_llama_cpp_does():
    """llama.cpp's Q4_K_M: attn_v and ffn_down in Q6_K for the first and last eighth of the
    layers and every third layer between; every other matrix as the q4_k mix."""
    assert [i for i in range(16) if more_bits_layer(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(32) if more_bits_layer(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29,
                                                               30, 31]
    m = {s.name: s.qtype for s in tensor_specs(SHAPES["llama-1b"], MIXES["q4_k_m"])}
    q = {s.name: s.qtype for s in tensor_specs(SHAPES["llama-1b"], MIXES["q4_k"])}
    changed = {k for k in m if m[k] != q[k]}
    assert changed == {f"blk.{i}.{t}.weight" for i in (0, 1, 4, 7, 10, 13, 14, 15) for t in ("attn_v", "ffn_down")}
    assert {m[k] for k in changed} == {QType.Q6_K}


def test_q4_k_m_file_loads_and_runs(tmp_path):
    """One layer (a more-bits layer): its attn_v and ffn_down load as Q6_K beside Q4_K q/k."""
    path = write_synthetic(tmp_path / "m.gguf", "llama-1b", "q4_k_m", n_layers=1, vocab_size=SMALL_VOCAB,
                           tokenizer_from="builtin")
    cfg, params, _ = load_gguf(path, progress=False)
    layer = params.layers[0]
    assert (layer.wq.qtype, layer.wv.qtype, layer.w_down.qtype) == (QType.Q4_K, QType.Q6_K, QType.Q6_K)
    a = _prefill_decode(cfg, params, steps=0)
    assert np.isfinite(a).all() and 0.2 < float(a.std()) < 5.0


def test_full_size_llama_8b_q4_k_layout():
    """The full llama-8b Q4_K plan, without writing it: 4.66 GB of tensors."""
    specs = tensor_specs(SHAPES["llama-8b"], MIXES["q4_k"])
    assert len(specs) == 2 + 32 * 9 + 1
    total = sum(s.nbytes for s in specs)
    per_layer = (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096) * 144 // 256 + 2 * 4096 * 4
    expected = 32 * per_layer + 128256 * 4096 * 144 // 256 + 128256 * 4096 * 210 // 256 + 4096 * 4
    assert total == expected
    assert 4.6e9 < total < 4.7e9


def test_generation_is_vectorized():
    """One llama-8b FFN matrix (33 MB of Q4_K) is made in well under a second, so the whole
    4.66 GB model's data takes seconds (the disk sets the pace)."""
    spec = TensorSpec("ffn", (14336, 4096), QType.Q4_K, MATRIX)
    random_tensor(spec, 0, 0)
    t0 = time.perf_counter()
    random_tensor(spec, 0, 1)
    assert time.perf_counter() - t0 < 2.0


def _prefill_decode(cfg, params, steps=3):
    cache = init_cache(cfg, 2, 64)
    tokens, lengths = engine.pad_prompts([[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]])
    logits, cache = engine.prefill(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths))
    out = [np.asarray(logits)]
    for _ in range(steps):
        logits, cache = engine.decode_step(cfg, params, cache, jnp.argmax(logits, -1).astype(jnp.int32))
        out.append(np.asarray(logits))
    return np.stack(out)


def test_runs_through_rjax_finite_and_deterministic(smollm2_q4_1):
    cfg, params, _ = load_gguf(smollm2_q4_1, progress=False)
    a = _prefill_decode(cfg, params)
    assert (cfg.n_layers, cfg.d_model, cfg.vocab_size) == (2, 576, 49152)
    assert a.shape == (4, 2, 49152)
    assert np.isfinite(a).all()
    # Logits of O(1): the planned weight scales keep activations in range.
    assert 0.2 < float(a.std()) < 5.0
    b = _prefill_decode(cfg, params)
    np.testing.assert_array_equal(a, b)


def test_qwen3_8b_has_its_parameter_count():
    specs = tensor_specs(SHAPES["qwen3-8b"], MIXES["q4_k"])
    assert sum(math.prod(s.shape) for s in specs) == 8_190_735_360  # Qwen3-8B's safetensors hold as many
    assert {s.name for s in specs} >= {"blk.35.attn_q_norm.weight", "blk.35.attn_k_norm.weight", "output.weight"}


@pytest.mark.parametrize("shape, total, active", [("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),
                                                   ("mixtral-8x7b", 46_702_792_704, 12_879_925_248)])
def test_mixture_of_experts_shapes_have_their_parameter_counts(shape, total, active):
    from rjax.cli.info import active_parameters

    s = SHAPES[shape]
    specs = tensor_specs(s, MIXES["q4_k"])
    assert sum(math.prod(t.shape) for t in specs) == total  # as the models' safetensors hold
    config = dict(d_model=s.d_model, expert_d_ff=s.expert_d_ff, n_layers=s.n_layers, n_experts=s.n_experts,
                  n_experts_used=s.n_experts_used)
    assert active_parameters(config, total) == active  # published: 3.3B and 12.9B active
    assert next(t for t in specs if t.name == "blk.0.ffn_down_exps.weight").shape == (s.n_experts, s.d_model,
                                                                                     s.expert_d_ff)


@pytest.mark.parametrize("shape,mix", [("qwen2.5-1.5b", "q4_k"), ("gemma3-1b", "q4_k")])
def test_other_architectures_run(tmp_path, shape, mix):
    """qwen2 (q/k/v biases) and gemma3 (q/k norms, post-norms, 256-wide heads, windows): prefill."""
    path = write_synthetic(tmp_path / "m.gguf", shape, mix, n_layers=1, vocab_size=SMALL_VOCAB,
                           tokenizer_from="builtin")
    cfg, params, _ = load_gguf(path, progress=False)
    a = _prefill_decode(cfg, params, steps=0)
    s = SHAPES[shape]
    assert (cfg.arch, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        s.arch, s.d_model, s.d_ff, s.n_heads, s.n_kv_heads, s.head_size)
    if shape == "gemma3-1b":
        assert cfg.layer_windows == (512,)
    assert np.isfinite(a).all() and 0.2 < float(a.std()) < 5.0


def test_seed_decides_the_bytes(tmp_path):
    kw = dict(n_layers=1, vocab_size=SMALL_VOCAB, tokenizer_from="builtin")
    a = write_synthetic(tmp_path / "a.gguf", "smollm2-135m", "q8_0", seed=1, **kw)
    b = write_synthetic(tmp_path / "b.gguf", "smollm2-135m", "q8_0", seed=1, **kw)
    c = write_synthetic(tmp_path / "c.gguf", "smollm2-135m", "q8_0", seed=2, **kw)
    assert _sha256(a) == _sha256(b) != _sha256(c)
    assert a.stat().st_size == c.stat().st_size


def test_tokenizer_padded_with_unused_tokens(tmp_path):
    path = write_synthetic(tmp_path / "t.gguf", "smollm2-135m", "q8_0", n_layers=1, vocab_size=300,
                           tokenizer_from="builtin")
    r = GGUFReader(path)
    tokens = _field(r, "tokenizer.ggml.tokens")
    types = _field(r, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == 300 == _field(r, "llama.vocab_size")
    assert len(set(tokens)) == 300
    assert tokens[258:] == [f"<|synthetic_{i}|>" for i in range(258, 300)]
    assert set(types[258:]) == {gguf.TokenType.UNUSED}
    assert tokens[257] == "<|endoftext|>" and _field(r, "tokenizer.ggml.eos_token_id") == 257


def test_tokenizer_copied_from_another_gguf(tmp_path):
    """Every tokenizer.* field of the source is copied (the default model's, when it is cached,
    goes the same way), and the vocabulary is padded to the shape's."""
    src = write_synthetic(tmp_path / "src.gguf", "smollm2-135m", "q8_0", n_layers=1, vocab_size=260,
                          tokenizer_from="builtin")
    out = write_synthetic(tmp_path / "out.gguf", "llama-1b", "q8_0", n_layers=1, vocab_size=290, tokenizer_from=src)
    a, b = GGUFReader(src), GGUFReader(out)
    keys = sorted(k for k in a.fields if k.startswith("tokenizer."))
    assert keys == sorted(k for k in b.fields if k.startswith("tokenizer."))
    for key in keys:
        if key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            assert _field(b, key) == _field(a, key), key
            assert b.fields[key].types == a.fields[key].types, key
    tokens = _field(b, "tokenizer.ggml.tokens")
    assert tokens[:260] == _field(a, "tokenizer.ggml.tokens") and len(tokens) == 290


def test_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(SynthError, match="unknown shape 'llama-70b'"):
        write_synthetic(tmp_path / "x.gguf", "llama-70b", "q4_k")
    with pytest.raises(SynthError, match="unknown quantization mix 'q3_k'"):
        write_synthetic(tmp_path / "x.gguf", "llama-1b", "q3_k")
    with pytest.raises(SynthError, match="258 tokens, more than the vocabulary of 100"):
        write_synthetic(tmp_path / "x.gguf", "llama-1b", "q4_k", n_layers=1, vocab_size=100, tokenizer_from="builtin")
    assert not list(tmp_path.iterdir())  # nothing half-written is left


def test_cli(tmp_path, capsys):
    from rjax.cli.main import main

    out = tmp_path / "cli.gguf"
    rc = main(["synth", "llama-1b", "--quant", "q4_k", "-o", str(out), "--layers", "1", "--vocab", str(SMALL_VOCAB),
               "--tokenizer-from", "builtin", "-q"])
    assert rc == 0 and out.exists()
    assert str(out) in capsys.readouterr().out
    r = GGUFReader(out)
    assert _field(r, "llama.block_count") == 1
    assert {t.name: t.tensor_type for t in r.tensors}["blk.0.ffn_up.weight"] == QType.Q4_K
