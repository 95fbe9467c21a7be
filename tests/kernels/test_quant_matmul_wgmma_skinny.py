"""The wgmma kernel (pallas_kernels/quant_matmul/wgmma_skinny.py: Q4_K, Q8_0, Q6_K, Q4_0, Q4_1, Q5_0) on the CPU: its
arithmetic and K order in jnp against gguf-py's dequantizer, the dispatch, the refusals, and the
lowering for sm_90. The kernel itself runs only on the H100 (no Mosaic GPU interpreter for inline
Mosaic code or wgmma operands in registers): tests/kernels/test_quant_matmul.py::test_wgmma_gpu."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from pallas_kernels.int8_activations import GatedX
from pallas_kernels.quant_matmul import gemv
from pallas_kernels.quant_matmul import wgmma_skinny as wg
from pallas_kernels.quant_matmul.testing import dequantized_product, random_qtensor, rel_error
from rjax.math.layout import gpu_weight_layout

BF16_TOL = 1e-2


def _weight(n, k, seed=0, qtype=QType.Q4_K):
    raw = random_qtensor(qtype, n, k, seed=seed)
    return raw, gpu_weight_layout(jax.tree.map(jnp.asarray, raw))


def _x(m, k, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), jnp.bfloat16)


def test_chunk_order_follows_the_wgmma_fragments():
    """A permutation of a chunk's 64 values; each thread's register pair is one byte pair of
    one of its two words, one nibble: low nibbles are values 0-31, high ones 32-63."""
    order = wg.chunk_order()
    assert sorted(order) == list(range(64))
    for col in range(0, 64, 2):
        b, j = col // 8, (col % 8) // 2
        word, nibble = 2 * j + (b >> 2), (b >> 1) & 1
        byte = 4 * word + 2 * (b & 1)
        assert (order[col], order[col + 1]) == (32 * nibble + byte, 32 * nibble + byte + 1)


ALL_TYPES = [QType.Q4_K, QType.Q8_0, QType.Q6_K, QType.Q4_0, QType.Q4_1, QType.Q5_0]


def test_blocks32_order_follows_the_wgmma_fragments():
    """Q4_0/Q4_1/Q5_0: thread j's words 2j + t of a chunk's eight are words 2 (j & 1) + t of block
    j >> 1; column block b takes word b >> 2, nibble (b >> 1) & 1 (low: value i of byte i, high:
    value i + 16), bytes 2 (b & 1) + e."""
    order = wg.blocks32_order()
    assert sorted(order) == list(range(64))
    for col in range(64):
        b, j, e = col // 8, (col % 8) // 2, col % 2
        block, word = j >> 1, 2 * (j & 1) + (b >> 2)
        byte = 4 * word + 2 * (b & 1) + e
        assert order[col] == 32 * block + 16 * ((b >> 1) & 1) + byte


@pytest.mark.parametrize("qtype", ALL_TYPES)
@pytest.mark.parametrize("m,n,k,bps", [(16, 128, 2048, 8), (5, 64, 512, 1), (33, 192, 4096, 4), (64, 64, 256, 1)])
def test_reference_arithmetic_against_gguf(m, n, k, bps, qtype):
    raw, w = _weight(n, k, seed=m + n, qtype=qtype)
    x = _x(m, k, seed=m)
    parts = wg.reference_arithmetic(x, w, wg.WgmmaConfig(blocks_per_split=bps))
    assert parts.shape == (k // 256 // bps, m, n) and parts.dtype == jnp.float32
    assert rel_error(parts.sum(axis=0), dequantized_product(x, raw)) < BF16_TOL


def test_q8_0_words_give_the_same_order():
    """Q8_0: column block b of a chunk takes block (b >> 1) & 1 of the two, its word 2j + (b >> 2)
    and bytes 2 (b & 1) + e: byte 32 * block + 4 * word + byte is chunk_order's value."""
    order = wg.chunk_order()
    for col in range(64):
        b, j, e = col // 8, (col % 8) // 2, col % 2
        assert order[col] == 32 * ((b >> 1) & 1) + 4 * (2 * j + (b >> 2)) + 2 * (b & 1) + e


def test_q8_0_weight_is_rounded_once():
    """Q8_0's tile holds bf16(v * bf16(d)): the quant exact, one rounding after the scale."""
    raw, w = _weight(64, 256, seed=5, qtype=QType.Q8_0)
    x = jnp.eye(256, dtype=jnp.bfloat16)[:64]    # rows of the identity read the weight's first 64 columns
    got = np.asarray(wg.reference_arithmetic(x, w).sum(axis=0)).T      # (n, 64): w[:, :64], permuted back
    v = np.asarray(raw.planes.qs, np.float32).reshape(64, 256)
    d = np.asarray(raw.planes.d, np.float32).reshape(64, 8)
    s = np.asarray(jnp.asarray(d).astype(jnp.bfloat16).astype(jnp.float32))
    want = np.asarray(jnp.asarray(v * np.repeat(s, 32, axis=1)).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(got, want[:, :64])


def test_weights_as_bytes_read_as_the_same_words():
    """A Q4_KChunks weight whose quants are still bytes gives the same operands as words."""
    from gguf_blocks.reference import q4_k_chunks

    raw, words = _weight(64, 512, seed=3)
    chunks = q4_k_chunks(jax.tree.map(jnp.asarray, raw))
    assert chunks.planes.qs.dtype == jnp.uint8 and words.planes.qs.dtype == jnp.int32
    x = _x(8, 512)
    np.testing.assert_array_equal(np.asarray(wg.reference_arithmetic(x, chunks)),
                                  np.asarray(wg.reference_arithmetic(x, words)))


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q6_K])
def test_bytes_and_words_read_alike(qtype):
    """A GPU model holds Q8_0 quants as words where the kernel takes the shape, small Q6_K
    weights as bytes and Q6_K LM heads as words: either gives the same operands."""
    from gguf_blocks.words import as_words

    raw, _ = _weight(64, 512, seed=4, qtype=qtype)
    as_bytes = jax.tree.map(jnp.asarray, raw)
    words = as_words(as_bytes)
    int32_planes = lambda w: sum(p.dtype == jnp.int32 for p in w.planes)
    assert int32_planes(as_bytes) == 0 and int32_planes(words) > 0
    x = _x(8, 512)
    np.testing.assert_array_equal(np.asarray(wg.reference_arithmetic(x, as_bytes)),
                                  np.asarray(wg.reference_arithmetic(x, words)))


def test_default_config_splits_k_for_programs():
    assert wg.default_config(14336, 4096) == wg.WgmmaConfig(blocks_per_split=8)   # 224 x 2 programs
    assert wg.default_config(4096, 14336).blocks_per_split == 8                    # 64 x 7
    assert wg.default_config(1024, 4096).blocks_per_split == 1                     # 16 x 16
    assert wg.default_config(4096, 4096).blocks_per_split == 4                     # 64 x 4
    for n, k in [(14336, 4096), (4096, 14336), (2048, 2048), (576, 1536)]:
        assert (k // 256) % wg.default_config(n, k).blocks_per_split == 0


def test_dispatch():
    raw, w = _weight(128, 512)
    x = _x(16, 512)
    assert not gemv.uses_wgmma(w, 16, x, interpret=False)      # under WGMMA_MIN_VALUES: the Triton kernel
    t = gemv.TUNING.replace(wgmma_min_values={q: 0 for q, _ in gemv.TUNING.wgmma_min_values})
    assert gemv.uses_wgmma(w, 16, x, interpret=False, tuning=t)
    assert gemv.decode_path(x, w, tuning=t) == "wgmma" and gemv.decode_path(x, w, interpret=True, tuning=t) == "float"
    assert gemv.decode_path(x[:1], w, tuning=t) == "int8_gemv"
    assert gemv.uses_wgmma(w, 64, _x(64, 512), interpret=False, tuning=t)
    assert not gemv.uses_wgmma(w, 16, x, interpret=True, tuning=t)                              # no interpreter
    assert not gemv.uses_wgmma(w, 1, x[:1], interpret=False, tuning=t)
    assert not gemv.uses_wgmma(w, 16, x.astype(jnp.float32), interpret=False, tuning=t)          # exact f32 path
    assert not gemv.uses_wgmma(jax.tree.map(jnp.asarray, raw), 16, x, interpret=False, tuning=t)  # the file's layout
    assert not gemv.uses_wgmma(_weight(96, 512)[1], 16, x, interpret=False, tuning=t)             # N % 64
    assert gemv.uses_wgmma(_weight(128, 512, qtype=QType.Q8_0)[1], 16, x, interpret=False, tuning=t)
    q6_k = _weight(128, 512, qtype=QType.Q6_K)[1]
    assert gemv.uses_wgmma(q6_k, 16, x, interpret=False, tuning=t) and gemv.uses_wgmma(q6_k, 1, x[:1], interpret=False, tuning=t)
    assert not gemv.uses_wgmma(_weight(128, 512, qtype=QType.Q5_K)[1], 16, x, interpret=False, tuning=t)
    for qtype in (QType.Q4_0, QType.Q4_1, QType.Q5_0):
        assert gemv.uses_wgmma(_weight(128, 512, qtype=qtype)[1], 16, x, interpret=False, tuning=t)
    q5_0 = _weight(128, 512, qtype=QType.Q5_0)[1]
    assert gemv.decode_path(x[:1], q5_0, tuning=t) == "wgmma"                  # one row too, as Q6_K
    assert gemv.decode_path(x[:1], _weight(128, 512, qtype=QType.Q4_0)[1], tuning=t) == "float"
    assert not gemv.uses_wgmma(_weight(128, 288, qtype=QType.Q8_0)[1], 16, _x(16, 288), interpret=False, tuning=t)  # K % 256
    assert not gemv.uses_wgmma(w, 16, GatedX(jnp.concatenate([x, x], 1), "silu"), interpret=False, tuning=t)
    assert not gemv.uses_wgmma(w, 16, x, interpret=False, tuning=t.replace(wgmma_max_m=0))
    # in the interpreter the dispatch keeps the Triton kernel
    assert rel_error(gemv.qmatmul_gemv(x, w, interpret=True, tuning=t), dequantized_product(x, raw)) < BF16_TOL
    # the rule reads only the type, layout and shape: llama-8b's smallest product qualifies, llama-1b's QKV not
    assert gemv.uses_wgmma(dataclasses.replace(w, shape=(4096, 4096)), 16, _x(16, 4096), interpret=False)
    assert not gemv.uses_wgmma(dataclasses.replace(w, shape=(3072, 2048)), 16, _x(16, 2048), interpret=False)


def test_refusals():
    raw, w = _weight(128, 512)
    with pytest.raises(NotImplementedError, match="GPU layout"):
        wg.wgmma_matmul(_x(16, 512), jax.tree.map(jnp.asarray, raw))
    with pytest.raises(NotImplementedError, match="multiple of 64"):
        wg.wgmma_matmul(_x(16, 512), _weight(96, 512)[1])
    with pytest.raises(ValueError, match="bf16"):
        wg.wgmma_matmul(_x(16, 512).astype(jnp.float32), w)
    with pytest.raises(ValueError, match="1..64 rows"):
        wg.wgmma_matmul(_x(65, 512), w)
    with pytest.raises(ValueError, match="do not split"):
        wg.wgmma_matmul(_x(16, 512), w, wg.WgmmaConfig(blocks_per_split=4))


@pytest.mark.parametrize("qtype,op", [(QType.Q4_K, "fma.rn.bf16x2"), (QType.Q8_0, "shfl.sync.idx"),
                                      (QType.Q6_K, "%laneid"), (QType.Q4_0, "0x43084308"),
                                      (QType.Q4_1, "shfl.sync.idx"), (QType.Q5_0, "bfe.u32")])
def test_lowers_to_mosaic_gpu_for_h100(qtype, op):
    """Traced and lowered to a Mosaic GPU custom call with the inline PTX and wgmma, at every
    M tile (16, 32, 64) and with one and several splits."""
    _, w = _weight(128, 2048, seed=1, qtype=qtype)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w)
    for m, bps in [(16, 8), (24, 2), (64, 1)]:
        lowered = wg.wgmma_matmul.trace(jax.ShapeDtypeStruct((m, 2048), jnp.bfloat16), shapes,
                                        wg.WgmmaConfig(blocks_per_split=bps)).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        assert "mosaic_gpu" in text and "lop3.b32" in text and op in text
