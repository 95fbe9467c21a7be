"""Synthetic GGUF models: real architectures and shapes, random but valid weights.

Benchmarks need the byte layout, tensor types and shapes of real models, not their values,
so `write_synthetic` writes a GGUF file that llama.cpp and rjax both load: the architecture
metadata of a named shape (`SHAPES`), a tokenizer, and tensors whose quantized blocks are
random bytes with their float16 scale fields overwritten by sane values, so activations stay
finite through every layer. Each matrix is scaled to an RMS of 1/sqrt(row length), so a
normalized input keeps an output RMS near 1. Norm weights are 1.0 (float32).

Quantization mixes (`MIXES`): "matmul" is every attention/FFN matrix; "output" is the LM head,
or the token embedding when the embedding is tied to it; "embed" is an untied embedding.

    mix     matmul  embed  output   (as llama-quantize would write, roughly)
    q4_k    Q4_K    Q4_K   Q6_K     (Q4_K_M without its Q6_K attn_v/ffn_down layers)
    q4_k_m  Q4_K    Q4_K   Q6_K     and Q6_K attn_v and ffn_down where llama.cpp's Q4_K_M
                                    gives them more bits: the first and last eighth of the
                                    layers and every third one between (`more_bits_layer`)
    q8_0   Q8_0    Q8_0   Q8_0
    q4_0   Q4_0    Q4_0   Q6_K
    q4_1   Q4_1    Q4_1   Q8_0     (the default model's mix: Q4_1 with a tied Q8_0 embedding)
    f16    F16     F16    F16

As in llama.cpp, a K-quant needs rows that are a multiple of 256 values; other rows fall back
to Q4_K -> Q5_0 and Q6_K -> Q8_0 (e.g. every matrix reading the 576-wide hidden state of
smollm2-135m, and the 1152-wide one of gemma3-1b).

Vocabulary: every shape keeps its real vocabulary size (the LM head is a large share of the
bytes a decode step reads). The tokenizer is the default model's (SmolLM2, 49,152 tokens,
byte-level BPE) when its file is in the local cache, else a minimal byte-level BPE tokenizer
built here; either is padded with never-produced UNUSED tokens ("<|synthetic_N|>") up to the
shape's vocabulary, so token ids and the embedding agree and the file is self-contained.
Rope scaling (Llama 3.x) is left out: it changes no cost and not every loader reads it.

Files are written tensor by tensor (GGUFWriter's header / tensor-info / data phases), so
memory holds one tensor at a time; random bytes come from SFC64's raw output (several GB/s).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import os
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, TokenType
from gguf import GGMLQuantizationType as QType
from tqdm.auto import tqdm

from gguf_blocks import formats
from rjax.loading.tokenizer import byte_alphabet

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The architecture and sizes of a named model (what its GGUF metadata says)."""

    name: str
    arch: str
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_eps: float
    head_dim: int = 0            # 0: d_model // n_heads
    tied_embeddings: bool = True
    sliding_window: int = 0      # gemma3: window of its local layers
    n_experts: int = 0           # a mixture of experts in place of the MLP: how many, how many a token
    n_experts_used: int = 0      # uses, and each expert's feed-forward size
    expert_d_ff: int = 0

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("smollm2-135m", "llama", 30, 576, 1536, 9, 3, 49152, 8192, 100000.0, 1e-5),
    Shape("llama-1b", "llama", 16, 2048, 8192, 32, 8, 128256, 131072, 500000.0, 1e-5),
    Shape("llama-8b", "llama", 32, 4096, 14336, 32, 8, 128256, 131072, 500000.0, 1e-5, tied_embeddings=False),
    Shape("qwen2.5-1.5b", "qwen2", 28, 1536, 8960, 12, 2, 151936, 32768, 1000000.0, 1e-6),
    Shape("qwen3-8b", "qwen3", 36, 4096, 12288, 32, 8, 151936, 40960, 1000000.0, 1e-6, head_dim=128,
          tied_embeddings=False),
    Shape("qwen3-30b-a3b", "qwen3moe", 48, 2048, 6144, 32, 4, 151936, 40960, 1000000.0, 1e-6, head_dim=128,
          tied_embeddings=False, n_experts=128, n_experts_used=8, expert_d_ff=768),
    Shape("mixtral-8x7b", "llama", 32, 4096, 14336, 32, 8, 32000, 32768, 1000000.0, 1e-5, tied_embeddings=False,
          n_experts=8, n_experts_used=2, expert_d_ff=14336),
    Shape("gemma3-1b", "gemma3", 26, 1152, 6912, 4, 1, 262144, 32768, 1000000.0, 1e-6, head_dim=256,
          sliding_window=512),
)}


@dataclasses.dataclass(frozen=True)
class QuantMix:
    matmul: QType
    embed: QType    # an untied token embedding
    output: QType   # the LM head, or the tied embedding that serves as it
    file_type: LlamaFileType
    more_bits: QType | None = None   # attn_v and ffn_down of the `more_bits_layer` layers


def more_bits_layer(i: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M stores as Q6_K."""
    return i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2


MIXES: dict[str, QuantMix] = {
    "q4_k": QuantMix(QType.Q4_K, QType.Q4_K, QType.Q6_K, LlamaFileType.MOSTLY_Q4_K_M),
    "q4_k_m": QuantMix(QType.Q4_K, QType.Q4_K, QType.Q6_K, LlamaFileType.MOSTLY_Q4_K_M, more_bits=QType.Q6_K),
    "q8_0": QuantMix(QType.Q8_0, QType.Q8_0, QType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": QuantMix(QType.Q4_0, QType.Q4_0, QType.Q6_K, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": QuantMix(QType.Q4_1, QType.Q4_1, QType.Q8_0, LlamaFileType.MOSTLY_Q4_1),
    "f16": QuantMix(QType.F16, QType.F16, QType.F16, LlamaFileType.MOSTLY_F16),
}

# llama.cpp's substitutes for K-quants on rows that are not a multiple of 256 values.
K_QUANT_FALLBACK = {QType.Q2_K: QType.Q4_0, QType.Q3_K: QType.Q4_0, QType.Q4_K: QType.Q5_0,
                    QType.Q5_K: QType.Q5_1, QType.Q6_K: QType.Q8_0}

NORM, MATRIX, BIAS = "norm", "matrix", "bias"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # logical numpy shape: (out, in) for matrices
    qtype: QType
    kind: str               # NORM, MATRIX or BIAS

    @property
    def nbytes(self) -> int:
        return formats.tensor_nbytes(self.qtype, self.shape)


class SynthError(ValueError):
    """A synthetic model that cannot be made as asked; the message says what and why."""


def _matrix_type(qtype: QType, row_len: int) -> QType:
    block = GGML_QUANT_SIZES[qtype][0]
    if row_len % block == 0:
        return qtype
    fallback = K_QUANT_FALLBACK.get(qtype)
    if fallback is None or row_len % GGML_QUANT_SIZES[fallback][0]:
        raise SynthError(f"rows of {row_len} values cannot be stored as {qtype.name}")
    return fallback


def tensor_specs(shape: Shape, mix: QuantMix, n_layers: int | None = None,
                 vocab_size: int | None = None) -> list[TensorSpec]:
    """Every tensor of the file, in the order written (llama.cpp's order: embedding, blocks, head)."""
    L = shape.n_layers if n_layers is None else n_layers
    V = vocab_size or shape.vocab_size
    d, hd = shape.d_model, shape.head_size
    q_out, kv_out = shape.n_heads * hd, shape.n_kv_heads * hd

    def mat(name, out, inp, qtype=mix.matmul):
        return TensorSpec(name, (out, inp), _matrix_type(qtype, inp), MATRIX)

    def vec(name, n, kind=NORM):
        return TensorSpec(name, (n,), QType.F32, kind)

    specs = [mat("token_embd.weight", V, d, mix.output if shape.tied_embeddings else mix.embed)]
    for i in range(L):
        b = f"blk.{i}."
        more = mix.more_bits if mix.more_bits and more_bits_layer(i, L) else mix.matmul
        specs += [vec(b + "attn_norm.weight", d), mat(b + "attn_q.weight", q_out, d),
                  mat(b + "attn_k.weight", kv_out, d), mat(b + "attn_v.weight", kv_out, d, more)]
        if shape.arch == "qwen2":
            specs += [vec(b + "attn_q.bias", q_out, BIAS), vec(b + "attn_k.bias", kv_out, BIAS),
                      vec(b + "attn_v.bias", kv_out, BIAS)]
        if shape.arch in ("gemma3", "qwen3", "qwen3moe"):
            specs += [vec(b + "attn_q_norm.weight", hd), vec(b + "attn_k_norm.weight", hd)]
        specs.append(mat(b + "attn_output.weight", d, q_out))
        if shape.arch == "gemma3":
            specs.append(vec(b + "post_attention_norm.weight", d))
        if shape.n_experts:  # llama.cpp keeps the router in F32 and stacks the experts' weights
            E, F = shape.n_experts, shape.expert_d_ff
            specs += [vec(b + "ffn_norm.weight", d), mat(b + "ffn_gate_inp.weight", E, d, QType.F32),
                      TensorSpec(b + "ffn_gate_exps.weight", (E, F, d), _matrix_type(mix.matmul, d), MATRIX),
                      TensorSpec(b + "ffn_up_exps.weight", (E, F, d), _matrix_type(mix.matmul, d), MATRIX),
                      TensorSpec(b + "ffn_down_exps.weight", (E, d, F), _matrix_type(more, F), MATRIX)]
        else:
            specs += [vec(b + "ffn_norm.weight", d), mat(b + "ffn_gate.weight", shape.d_ff, d),
                      mat(b + "ffn_up.weight", shape.d_ff, d), mat(b + "ffn_down.weight", d, shape.d_ff, more)]
        if shape.arch == "gemma3":
            specs.append(vec(b + "post_ffw_norm.weight", d))
    specs.append(vec("output_norm.weight", d))
    if not shape.tied_embeddings:
        specs.append(mat("output.weight", V, d, mix.output))
    return specs


# ---------------------------------------------------------------------------------------------
# random tensor data

def _rng(seed: int, index: int) -> np.random.SFC64:
    """One bit generator per tensor, so a tensor's bytes do not depend on the ones before it."""
    return np.random.SFC64(np.random.SeedSequence([seed, index]))


def _random_bytes(bitgen: np.random.SFC64, n: int) -> np.ndarray:
    return bitgen.random_raw((n + 7) // 8).view(np.uint8)[:n]


def _uniform(bitgen: np.random.SFC64, n: int, lo: float, hi: float) -> np.ndarray:
    u = bitgen.random_raw((n + 3) // 4).view(np.uint16)[:n].astype(np.float32)
    return lo + (hi - lo) / 65535.0 * u


def _scale_fields(qtype: QType) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(scale fields, offset fields) of a block type as (name, byte offset): the float16 fields,
    `d` multiplying the quants and the others (`dmin`, `m`) adding an offset."""
    scales, offsets, off = [], [], 0
    for f in formats.LAYOUTS[qtype][1]:
        if f.dtype == np.float16 and f.shape == ():
            (scales if f.name == "d" else offsets).append((f.name, off))
        off += np.dtype(f.dtype).itemsize * math.prod(f.shape)
    return scales, offsets


def _set_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)


@functools.cache
def block_calibration(qtype: QType) -> tuple[float, float]:
    """(d per unit RMS, offset field per unit d) for random blocks of `qtype`.

    Measured, not derived per type: random blocks with d = 1 (offsets 0, then 1) are
    dequantized by gguf's reference dequantizer. With these, d = rms * first and
    offset = d * second give values of that RMS and (in expectation) zero mean.
    """
    n_blocks = 4096
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = _random_bytes(_rng(12345, int(qtype)), n_blocks * type_size).reshape(n_blocks, type_size).copy()
    scales, offsets = _scale_fields(qtype)
    for _, off in scales:
        _set_f16(blocks, off, np.ones(n_blocks))
    for _, off in offsets:
        _set_f16(blocks, off, np.zeros(n_blocks))
    x0 = gguf.quants.dequantize(blocks, qtype).astype(np.float64)
    if not offsets:
        return 1.0 / float(np.sqrt(np.mean(x0 * x0))), 0.0
    for _, off in offsets:
        _set_f16(blocks, off, np.ones(n_blocks))
    x1 = gguf.quants.dequantize(blocks, qtype).astype(np.float64)
    slope = float(x1.mean() - x0.mean())  # mean shift per unit of the offset field
    offset_per_d = -float(x0.mean()) / slope
    # Random per-sub-block mins add spread of their own: measure the RMS with the offset applied.
    for _, off in offsets:
        _set_f16(blocks, off, np.full(n_blocks, offset_per_d))
    x = gguf.quants.dequantize(blocks, qtype).astype(np.float64)
    return 1.0 / float(np.sqrt(np.mean(x * x))), offset_per_d


def random_tensor(spec: TensorSpec, seed: int, index: int) -> np.ndarray:
    """The tensor's data as written to the file: raw block bytes (rows, row bytes) uint8 for
    quantized types, else a dense array of the logical shape."""
    bitgen = _rng(seed, index)
    if spec.kind == NORM:
        return np.ones(spec.shape, np.float32)
    if spec.kind == BIAS:
        return _uniform(bitgen, math.prod(spec.shape), -0.02, 0.02).reshape(spec.shape)
    rows, row_len = math.prod(spec.shape[:-1]), spec.shape[-1]
    target_rms = 1.0 / math.sqrt(row_len)
    if spec.qtype in formats.DENSE_TYPES:
        half_width = target_rms * math.sqrt(3.0)  # uniform on [-a, a] has RMS a / sqrt(3)
        out = np.empty(spec.shape, formats.DENSE_TYPES[spec.qtype]).reshape(rows, row_len)
        step = max(1, (1 << 22) // row_len)
        for r in range(0, rows, step):
            n = min(step, rows - r)
            out[r:r + n] = _uniform(bitgen, n * row_len, -half_width, half_width).reshape(n, row_len)
        return out.reshape(spec.shape)
    if spec.qtype not in formats.LAYOUTS:
        raise SynthError(f"tensor {spec.name!r}: cannot make random blocks of type {spec.qtype.name}")
    block_size, type_size = GGML_QUANT_SIZES[spec.qtype]
    n_blocks = rows * row_len // block_size
    data = _random_bytes(bitgen, n_blocks * type_size)
    blocks = data.reshape(n_blocks, type_size)
    d_per_rms, offset_per_d = block_calibration(spec.qtype)
    scales, offsets = _scale_fields(spec.qtype)
    # A spread of block scales, as real weights have; the RMS stays within a few % of target.
    d = (target_rms * d_per_rms) * _uniform(bitgen, n_blocks, 0.75, 1.25)
    for _, off in scales:
        _set_f16(blocks, off, d)
    for _, off in offsets:
        _set_f16(blocks, off, d * offset_per_d)
    return data.reshape(rows, row_len // block_size * type_size)


# ---------------------------------------------------------------------------------------------
# tokenizer metadata

BUILTIN_TOKENIZER = "builtin"


def _builtin_tokenizer() -> dict[str, tuple]:
    """A minimal byte-level BPE tokenizer: the 256 bytes, one merge, one end-of-text token."""
    tokens = list(byte_alphabet().values()) + ["Ġt", "<|endoftext|>"]
    types = [int(TokenType.NORMAL)] * 257 + [int(TokenType.CONTROL)]
    eot = len(tokens) - 1
    S, A, U32, I32, B = (GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.UINT32,
                         GGUFValueType.INT32, GGUFValueType.BOOL)
    return {
        "tokenizer.ggml.model": ("gpt2", S, None),
        "tokenizer.ggml.pre": ("default", S, None),
        "tokenizer.ggml.tokens": (tokens, A, S),
        "tokenizer.ggml.token_type": (types, A, I32),
        "tokenizer.ggml.merges": (["Ġ t"], A, S),
        "tokenizer.ggml.bos_token_id": (eot, U32, None),
        "tokenizer.ggml.eos_token_id": (eot, U32, None),
        "tokenizer.ggml.add_bos_token": (False, B, None),
    }


def tokenizer_fields(source: str | os.PathLike | None = None) -> tuple[dict[str, tuple], str]:
    """The `tokenizer.*` metadata to copy, as {key: (value, type, array item type)}, and where
    it came from. `source`: a GGUF file, or "builtin" for the built-in byte-level tokenizer;
    None: the default model if it is in the local cache, else the built-in tokenizer."""
    if source == BUILTIN_TOKENIZER:
        return _builtin_tokenizer(), "built-in byte-level BPE"
    if source is None:
        from rjax.loading.catalog import DEFAULT_MODEL, CatalogError, resolve_model

        try:
            source = resolve_model(DEFAULT_MODEL, pull_missing=False, progress=False)
        except (CatalogError, OSError) as e:
            log.info("default model not available (%s); using the built-in byte-level tokenizer", e)
            return _builtin_tokenizer(), "built-in byte-level BPE"
    return _read_tokenizer(str(source)), str(source)


@functools.lru_cache(maxsize=4)
def _read_tokenizer(source: str) -> dict[str, tuple]:
    """Parsing a GGUF header with a large vocabulary takes seconds: read each file once."""
    reader = GGUFReader(source, "r")
    out = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        out[key] = (field.contents(), vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    if "tokenizer.ggml.tokens" not in out:
        raise SynthError(f"{source}: has no tokenizer.ggml.tokens to copy")
    return out


def _pad_vocabulary(fields: dict[str, tuple], vocab_size: int, source: str) -> dict[str, tuple]:
    tokens = fields["tokenizer.ggml.tokens"][0]
    n = len(tokens)
    if n > vocab_size:
        raise SynthError(f"the tokenizer from {source} has {n} tokens, more than the vocabulary of "
                         f"{vocab_size}; give a vocabulary of at least {n}")
    if n == vocab_size:
        return fields
    extra = vocab_size - n
    out = dict(fields)
    out["tokenizer.ggml.tokens"] = (list(tokens) + [f"<|synthetic_{i}|>" for i in range(n, vocab_size)],
                                    *fields["tokenizer.ggml.tokens"][1:])
    if "tokenizer.ggml.token_type" in fields:
        v, t, s = fields["tokenizer.ggml.token_type"]
        out["tokenizer.ggml.token_type"] = (list(v) + [int(TokenType.UNUSED)] * extra, t, s)
    if "tokenizer.ggml.scores" in fields:
        v, t, s = fields["tokenizer.ggml.scores"]
        out["tokenizer.ggml.scores"] = (list(v) + [-1e9] * extra, t, s)
    return out


# ---------------------------------------------------------------------------------------------
# the file

def _add_architecture(w: GGUFWriter, shape: Shape, n_layers: int, vocab_size: int, mix_name: str,
                      mix: QuantMix, seed: int) -> None:
    w.add_type("model")
    w.add_name(f"synthetic {shape.name} {mix_name}")
    w.add_description(f"rjax synthetic model: shape {shape.name}, mix {mix_name}, seed {seed}; random weights")
    w.add_block_count(n_layers)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.d_model)
    w.add_feed_forward_length(shape.d_ff)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_key_length(shape.head_size)
    w.add_value_length(shape.head_size)
    w.add_rope_dimension_count(shape.head_size)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.sliding_window:
        w.add_sliding_window(shape.sliding_window)
    if shape.n_experts:
        w.add_expert_count(shape.n_experts)
        w.add_expert_used_count(shape.n_experts_used)
        w.add_expert_feed_forward_length(shape.expert_d_ff)
    w.add_vocab_size(vocab_size)
    w.add_file_type(int(mix.file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_synthetic(path: str | os.PathLike, shape_name: str | Shape, quant: str, seed: int = 0,
                    n_layers: int | None = None, *, vocab_size: int | None = None,
                    tokenizer_from: str | os.PathLike | None = None, progress: bool = False) -> Path:
    """Write a synthetic GGUF of shape `SHAPES[shape_name]` (or a `Shape` given whole: a tiny test
    model) with quantization mix `MIXES[quant]`.

    `n_layers` overrides the shape's layer count (small test files); `vocab_size` its
    vocabulary (at least the tokenizer's); `tokenizer_from` names a GGUF to copy the tokenizer
    from (default: see `tokenizer_fields`). The file appears complete or not at all: it is
    written beside `path` and renamed. -> path.
    """
    if not isinstance(shape_name, Shape) and shape_name not in SHAPES:
        raise SynthError(f"unknown shape {shape_name!r}; known: {', '.join(SHAPES)}")
    if quant not in MIXES:
        raise SynthError(f"unknown quantization mix {quant!r}; known: {', '.join(MIXES)}")
    shape, mix = shape_name if isinstance(shape_name, Shape) else SHAPES[shape_name], MIXES[quant]
    L = shape.n_layers if n_layers is None else int(n_layers)
    if L < 1:
        raise SynthError(f"n_layers must be >= 1, got {L}")
    V = int(vocab_size or shape.vocab_size)
    tok_fields, tok_source = tokenizer_fields(tokenizer_from)
    tok_fields = _pad_vocabulary(tok_fields, V, tok_source)
    specs = tensor_specs(shape, mix, L, V)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    w = GGUFWriter(partial, shape.arch)
    try:
        _add_architecture(w, shape, L, V, quant, mix, seed)
        for key, (value, vtype, sub_type) in tok_fields.items():
            w.add_key_value(key, value, vtype, sub_type)
        for s in specs:
            # A logical numpy shape with raw_dtype: the writer stores it reversed (GGUF's ne order).
            w.add_tensor_info(s.name, s.shape, np.dtype(np.float32), s.nbytes, raw_dtype=s.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(s.nbytes for s in specs)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {path.name}", disable=not progress,
                  leave=False) as bar:
            for i, s in enumerate(specs):
                data = random_tensor(s, seed, i)
                if data.nbytes != s.nbytes:
                    raise AssertionError(f"tensor {s.name}: made {data.nbytes} bytes, expected {s.nbytes}")
                w.write_tensor_data(data)
                bar.update(s.nbytes)
        w.close()
        os.replace(partial, path)
    except BaseException:
        w.close()
        partial.unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------------------------
# command line

def cmd_synth(a) -> int:
    import time

    t0 = time.perf_counter()
    path = write_synthetic(a.output, a.shape, a.quant, seed=a.seed, n_layers=a.layers, vocab_size=a.vocab,
                           tokenizer_from=a.tokenizer_from, progress=not a.quiet)
    size = path.stat().st_size
    dt = time.perf_counter() - t0
    print(f"{path}  {size / 1e9:.3f} GB  {dt:.1f} s  ({size / 1e9 / max(dt, 1e-9):.2f} GB/s)")
    return 0


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("synth", help="write a synthetic GGUF model (real shapes, random weights)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--quant", default="q4_k", choices=sorted(MIXES), help="quantization mix (default: q4_k)")
    p.add_argument("-o", "--output", required=True, help="path of the .gguf file to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="number of blocks (default: the shape's)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the shape's)")
    p.add_argument("--tokenizer-from", default=None,
                   help="GGUF file to copy the tokenizer from, or 'builtin' (default: the default "
                        "model if cached, else the built-in byte-level tokenizer)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_synth)
