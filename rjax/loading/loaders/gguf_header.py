"""The GGUF header: metadata and tensor directory, bounded by the file's size, and the config they give.

Nothing here imports jax, so `rjax info` reads a model's header in a fraction of a second. With
`string_arrays=False` the reader steps over arrays of strings (the tokenizer's vocabulary and
merges, most of the header's parse time) and keeps only their length.
"""
from __future__ import annotations

import dataclasses
import math
import os
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from rjax.loading.loaders.errors import MAX_CONTEXT, MAX_DIM, MAX_LAYERS, MAX_VOCAB, ModelFileError
from rjax.math.config import ModelConfig, RopeScaling, SUPPORTED_ARCHITECTURES, longrope_context

GGUF_MAGIC = b"GGUF"
GGML_MAX_DIMS = 4  # llama.cpp's limit on a tensor's dimensions

# Fewest bytes one array item of each type takes: an array's count is checked against this.
_MIN_ITEM_BYTES = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12,
                   **{t: np.dtype(d).itemsize for t, d in GGUFReader.gguf_scalar_to_np.items()}}


class _PastEnd(ValueError):
    """The header points past the end of the file."""


class _BoundedReader(GGUFReader):
    """gguf's reader, with what a damaged header can make it do bounded by the file's size.

    gguf's reader trusts every count: a read past the end yields an empty view (which it then
    indexes, or loops on forever), an array of a billion items is parsed item by item, and a
    tensor's element count is a wrapping uint64 product. Here a read past the end raises, an
    array's count is checked against the bytes left before its items are parsed, arrays of
    numbers are viewed whole (one part, not one per item), and each tensor's byte range is
    checked against the file before it is viewed."""

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if int(count) < 0 or end > len(self.data):
            raise _PastEnd(f"reading {int(count):,} x {np.dtype(dtype).name} at byte {int(offset):,} "
                           f"runs past the end of the file ({len(self.data):,} bytes)")
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_item_type = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        try:
            item_type = GGUFValueType(int(raw_item_type[0]))
        except ValueError:
            raise ValueError(f"array at byte {orig_offs:,} has unknown item type {int(raw_item_type[0])}") from None
        n = int(count[0])
        if orig_offs + 12 + n * _MIN_ITEM_BYTES[item_type] > len(self.data):
            raise _PastEnd(f"an array at byte {orig_offs:,} claims {n:,} items of {item_type.name}, more than "
                           f"the {len(self.data) - orig_offs - 12:,} bytes left in the file hold")
        if item_type == GGUFValueType.STRING:
            return self._string_array_parts(orig_offs, raw_item_type, count, n)
        np_type = self.gguf_scalar_to_np.get(item_type)
        if np_type is None:  # nested arrays: item by item, each read bounded
            return super()._get_field_parts(orig_offs, raw_type)
        items = self._get(orig_offs + 12, np_type, n)
        return 12 + int(items.nbytes), [raw_item_type, count, items], [2], [GGUFValueType.ARRAY, item_type]

    def _string_array_parts(self, orig_offs, raw_item_type, count, n):
        """The parts gguf's reader makes of an array of n strings (each string's length, then its
        bytes), found by reading the lengths as Python ints and slicing a plain array view of the
        file. gguf's own loop makes a memmap object of every slice, which costs a vocabulary of
        50k tokens and 50k merges seconds at every load."""
        plain, mv = self.data.view(np.ndarray), memoryview(self.data)
        u64 = np.dtype(np.uint64).newbyteorder(self.byte_order)
        order = "big" if u64.byteorder == ">" or (u64.byteorder in "=|" and sys.byteorder == "big") else "little"
        parts, data_idxs, offs, end = [raw_item_type, count], [], orig_offs + 12, len(plain)
        for i in range(n):
            if offs + 8 > end:
                raise _PastEnd(f"string {i:,} of the array at byte {orig_offs:,} starts past the end of the file "
                               f"({end:,} bytes)")
            slen = int.from_bytes(mv[offs:offs + 8], order)
            if offs + 8 + slen > end:
                raise _PastEnd(f"string {i:,} of the array at byte {orig_offs:,} claims {slen:,} bytes at byte "
                               f"{offs + 8:,}, past the end of the file ({end:,} bytes)")
            parts += (plain[offs:offs + 8].view(u64), plain[offs + 8:offs + 8 + slen])
            data_idxs.append(len(parts) - 1)
            offs += 8 + slen
        return offs - orig_offs, parts, data_idxs, [GGUFValueType.ARRAY] + [GGUFValueType.STRING] * bool(n)

    def _build_tensors(self, start_offs, fields):
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            label = bytes(name).decode("utf-8", "replace")
            if len(dims) > GGML_MAX_DIMS:
                raise ValueError(f"tensor {label!r} has {len(dims)} dimensions; at most {GGML_MAX_DIMS} are allowed")
            try:
                qtype = GGMLQuantizationType(int(raw_type[0]))
            except ValueError:
                raise ValueError(f"tensor {label!r} has unknown GGML type id {int(raw_type[0])}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            shape = [int(d) for d in dims]  # Python ints: a product that does not wrap
            if shape and shape[0] % block:
                raise ValueError(f"tensor {label!r} ({qtype.name}): row length {shape[0]} is not a multiple of "
                                 f"its block size {block}")
            start, nbytes = int(start_offs) + int(offset[0]), math.prod(shape) // block * type_size
            if start + nbytes > len(self.data):
                raise _PastEnd(f"tensor {label!r} ({qtype.name}, shape {shape[::-1]}) needs bytes {start:,} to "
                               f"{start + nbytes:,}, but the file has {len(self.data):,}")
        super()._build_tensors(start_offs, fields)


class _HeaderReader(_BoundedReader):
    """A `_BoundedReader` that steps over arrays of strings, keeping only their item type and
    length (the field's `contents()` is empty): gguf's reader builds two arrays per string."""

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type == GGUFValueType.ARRAY and int(self._get(orig_offs, np.uint32)[0]) == GGUFValueType.STRING:
            raw_item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            order = "=" if self.byte_order == "I" else "<" if sys.byteorder == "big" else ">"
            length = struct.Struct(order + "Q").unpack_from
            view, end, offs, n, seen = memoryview(self.data), len(self.data), orig_offs + 12, int(count[0]), 0
            while seen < n and offs + 8 <= end:
                offs += 8 + length(view, offs)[0]
                seen += 1
            if seen < n or offs > end:
                raise _PastEnd(f"an array of {n:,} strings at byte {orig_offs:,} runs past the end of the file "
                               f"({end:,} bytes)")
            return offs - orig_offs, [raw_item_type, count], [], [GGUFValueType.ARRAY, GGUFValueType.STRING]
        return super()._get_field_parts(orig_offs, raw_type)


def open_gguf(path: str | os.PathLike, *, string_arrays: bool = True) -> GGUFReader:
    """gguf's reader over `path`, every read bounded by the file; `string_arrays=False` steps over
    arrays of strings (their fields keep the item type and length, no items)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return (_BoundedReader if string_arrays else _HeaderReader)(path, "r")
    except _PastEnd as e:
        raise ModelFileError(f"{path} is truncated or corrupt: {e}") from e
    except Exception as e:  # the gguf parser raises many types on a damaged header
        raise ModelFileError(f"{path} is truncated or corrupt ({path.stat().st_size:,} bytes): the GGUF reader "
                             f"failed with {type(e).__name__}: {e}") from e


class _Unreadable:
    """A metadata value the reader could not decode (e.g. a string that is not UTF-8)."""

    def __init__(self, error: Exception):
        self.error = error

    def __repr__(self):
        return f"<unreadable: {type(self.error).__name__}: {self.error}>"


def metadata(reader: GGUFReader) -> dict:
    """All metadata fields except the tokenizer's arrays, as Python values; a value that cannot be
    decoded is kept as an `_Unreadable` marker, an error only where a config needs it."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and field.types and field.types[0] == GGUFValueType.ARRAY:
            continue
        try:
            out[key] = field.contents()
        except Exception as e:  # noqa: BLE001 - e.g. invalid UTF-8, reported where the value is needed
            out[key] = _Unreadable(e)
    return out


class _Meta:
    """Typed access to one architecture's metadata keys; errors name the file and the key."""

    def __init__(self, meta: dict, arch: str, path):
        self.meta, self.arch, self.path = meta, arch, path

    def raw(self, key: str, default=None, required: bool = True):
        full = f"{self.arch}.{key}"
        value = self.meta.get(full)
        if isinstance(value, _Unreadable):
            self.fail(f"metadata key {full!r} cannot be read: {value.error}")
        if value is None:
            if required and default is None:
                self.fail(f"missing metadata key {full!r}")
            return default
        return value

    def int(self, key: str, default=None, required: bool = True, minimum: int = 1, maximum: int = MAX_DIM,
            per_layer: bool = False):
        value = self.raw(key, default, required)
        if value is None:
            return None
        if per_layer and isinstance(value, list) and value:  # per-layer arrays: one value for every layer
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            self.fail(f"metadata key '{self.arch}.{key}' = {value!r:.80} is not an integer in "
                      f"[{minimum}, {maximum:,}]")
        return value

    def float(self, key: str, default=None, required: bool = True) -> float:
        value = self.raw(key, default, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            self.fail(f"metadata key '{self.arch}.{key}' = {value!r:.80} is not a positive number")
        return float(value)

    def str(self, key: str, default: str) -> str:
        value = self.raw(key, default, required=False)
        if not isinstance(value, str):
            self.fail(f"metadata key '{self.arch}.{key}' = {value!r:.80} is not a string")
        return value

    def fail(self, message: str):
        raise ModelFileError(f"{self.path}: {message}")


# The architectures a GGUF may name: the config's, and qwen3moe (Qwen3 with experts).
GGUF_ARCHITECTURES = (*SUPPORTED_ARCHITECTURES, "qwen3moe")


def config_from_metadata(meta: dict, path: str | os.PathLike = "<gguf>") -> ModelConfig:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise ModelFileError(f"{path}: unsupported architecture {arch!r:.80} (general.architecture); "
                             f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    m = _Meta(meta, arch, path)
    n_layers = m.int("block_count", maximum=MAX_LAYERS)
    d_model = m.int("embedding_length")
    n_heads = m.int("attention.head_count", per_layer=True)
    n_kv = m.int("attention.head_count_kv", n_heads, per_layer=True)
    if n_heads % n_kv:
        m.fail(f"{arch}.attention.head_count {n_heads} is not a multiple of {arch}.attention.head_count_kv {n_kv}")
    if f"{arch}.attention.key_length" not in meta and d_model % n_heads:
        m.fail(f"{arch}.embedding_length {d_model} is not a multiple of {arch}.attention.head_count {n_heads}, "
               f"and no {arch}.attention.key_length gives the head size")
    head_dim = m.int("attention.key_length", max(1, d_model // n_heads), minimum=2)
    if head_dim % 2:  # rope rotates pairs of values
        m.fail(f"{arch}.attention.key_length {head_dim} is odd; rope needs an even head size")
    d_ff = m.int("feed_forward_length", per_layer=True)
    vocab = m.int("vocab_size", required=False, maximum=MAX_VOCAB)
    rope_theta = m.float("rope.freq_base", 10000.0)
    scaling = None
    scaling_type = m.str("rope.scaling.type", "")
    if scaling_type not in ("", "none", "linear", "llama3"):
        raise ModelFileError(f"{path}: rope scaling type {scaling_type!r} ({arch}.rope.scaling.type) is not "
                             "supported; supported: none, linear, llama3")
    # linear scaling divides positions by the factor (gemma3: on its global layers only)
    linear = m.float("rope.scaling.factor", 1.0, required=False) if scaling_type == "linear" else 1.0
    if scaling_type == "llama3" or f"{arch}.rope.scaling.low_freq_factor" in meta:
        scaling = RopeScaling(m.float("rope.scaling.factor"), m.float("rope.scaling.low_freq_factor", 1.0),
                              m.float("rope.scaling.high_freq_factor", 4.0),
                              m.int("rope.scaling.original_context_length", maximum=MAX_CONTEXT))
    common = dict(arch=arch, n_layers=n_layers, d_model=d_model, d_ff=d_ff, n_heads=n_heads,
                  n_kv_heads=n_kv, head_dim=head_dim, vocab_size=vocab or 0,
                  context_length=m.int("context_length", maximum=MAX_CONTEXT),
                  rms_eps=m.float("attention.layer_norm_rms_epsilon"), rope_theta=rope_theta,
                  rope_scaling=scaling)
    window = m.int("attention.sliding_window", 0, required=False, minimum=0, maximum=MAX_CONTEXT)
    n_experts = m.int("expert_count", 0, required=False, minimum=0, maximum=4096)
    if n_experts:  # Mixtral is written as llama with experts, Qwen3-MoE as qwen3moe
        used = m.int("expert_used_count", maximum=n_experts)
        norm = m.raw("expert_weights_norm", True, required=False)  # llama.cpp renormalizes unless told not to
        common.update(n_experts=n_experts, n_experts_used=used, expert_norm=bool(norm),
                      expert_d_ff=m.int("expert_feed_forward_length", d_ff, required=False))
    elif arch == "qwen3moe":
        m.fail(f"missing metadata key '{arch}.expert_count' (a {arch} model has experts)")
    if arch == "qwen3moe":  # Qwen3's layers with a mixture of experts for the MLP
        arch = common["arch"] = "qwen3"
    try:
        if arch == "llama":
            return ModelConfig(**common, rope_pairing="pairs", layer_rope_linear=(linear,) * n_layers,
                               layer_windows=(window or None,) * n_layers if window else ())
        if arch in ("qwen2", "qwen3"):  # qwen2: biases on q, k, v; qwen3: per-head norms of q and k instead
            return ModelConfig(**common, rope_pairing="halves", qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                               layer_rope_linear=(linear,) * n_layers,
                               layer_windows=(window or None,) * n_layers if window else ())
        if arch == "phi3":
            # LongRoPE: the frequency factors are tensors (read in config_from_reader); the
            # attention factor scales rope's cos and sin, so it scales every q.k by its square
            attn_factor = m.float("rope.scaling.attn_factor", 1.0, required=False)
            return ModelConfig(**common, rope_pairing="halves", layer_rope_linear=(linear,) * n_layers,
                               attn_scale=attn_factor ** 2 / math.sqrt(head_dim),
                               layer_windows=(window or None,) * n_layers if window else ())
        # gemma3: five sliding-window layers (rope base 10k) then one global layer (rope base from the file),
        # unless the file says otherwise: a pattern n (every n-th layer global) or one flag per layer
        # (true: sliding window), and the sliding layers' rope base
        pattern = m.raw("attention.sliding_window_pattern", 6, required=False)
        if isinstance(pattern, list):
            if len(pattern) != n_layers or not all(isinstance(p, bool) for p in pattern):
                m.fail(f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries for {n_layers} layers"
                       if len(pattern) != n_layers else
                       f"{arch}.attention.sliding_window_pattern must be one bool per layer, got {pattern!r:.80}")
            is_global = tuple(not p for p in pattern)
        else:
            pattern = m.int("attention.sliding_window_pattern", 6, required=False, minimum=0, maximum=MAX_LAYERS)
            is_global = tuple(pattern > 0 and (i + 1) % pattern == 0 for i in range(n_layers))  # 0: none
        if not window and not all(is_global):
            m.fail(f"{arch} has sliding-window layers but no {arch}.attention.sliding_window (or 0)")
        local_theta = m.float("rope.freq_base_swa", 10000.0, required=False)
        # llama.cpp's rule: the 62-layer (27B) model scales queries by its d_model / n_heads (Gemma's
        # query_pre_attn_scalar), the others by head_dim.
        attn_scale = (d_model / n_heads) ** -0.5 if n_layers == 62 else 0.0
        return ModelConfig(**common, rope_pairing="halves", qk_norm=True, post_norms=True,
                           activation="gelu_tanh", embed_scale=math.sqrt(d_model), attn_scale=attn_scale,
                           layer_windows=tuple(None if g else window for g in is_global),
                           layer_rope_theta=tuple(rope_theta if g else local_theta for g in is_global),
                           layer_rope_linear=tuple(linear if g else 1.0 for g in is_global))
    except ValueError as e:  # ModelConfig's own consistency checks
        if isinstance(e, ModelFileError):
            raise
        raise ModelFileError(f"{path}: {e}") from e

def config_from_reader(reader: GGUFReader, path: str | os.PathLike = "<gguf>") -> ModelConfig:
    cfg = config_from_metadata(metadata(reader), path)
    if not cfg.vocab_size:  # most files carry it only as the embedding's row count
        emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if emb is None:
            raise ModelFileError(f"{path}: missing tensor 'token_embd.weight'")
        if len(emb.shape) != 2 or not 1 <= int(emb.shape[1]) <= MAX_VOCAB:
            raise ModelFileError(f"{path}: tensor 'token_embd.weight' has shape {emb.shape[::-1].tolist()}; "
                                 f"expected (vocabulary up to {MAX_VOCAB:,}, {cfg.d_model})")
        cfg = dataclasses.replace(cfg, vocab_size=int(emb.shape[1]))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    if tied != cfg.tie_embeddings:  # the file says it by having (or not) a separate head
        cfg = dataclasses.replace(cfg, tie_embeddings=tied)
    factors = _freq_factors(reader, "rope_freqs.weight", cfg, path)
    if factors is not None:  # llama.cpp's form of Llama-3 rope scaling: per-frequency divisors
        cfg = dataclasses.replace(cfg, rope_freq_factors=factors, rope_scaling=None)
    short = _freq_factors(reader, "rope_factors_short.weight", cfg, path)
    if short is not None:  # Phi-3's LongRoPE
        long = _freq_factors(reader, "rope_factors_long.weight", cfg, path)
        original = _Meta(metadata(reader), cfg.arch, path).int("rope.scaling.original_context_length",
                                                               maximum=MAX_CONTEXT)
        cfg = dataclasses.replace(cfg, rope_freq_factors=short,
                                  context_length=longrope_context(cfg.context_length, original, short, long))
    return cfg


def _freq_factors(reader: GGUFReader, name: str, cfg: ModelConfig, path) -> tuple[float, ...] | None:
    """A tensor of per-frequency rope divisors (head_dim // 2 positive numbers), or None if absent."""
    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        return None
    if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        raise ModelFileError(f"{path}: tensor {name!r} is {t.tensor_type.name}; expected F32")
    factors = np.asarray(t.data, np.float32).reshape(-1)
    if factors.size != cfg.head_dim // 2:
        raise ModelFileError(f"{path}: tensor {name!r} has {factors.size} values; "
                             f"head_dim {cfg.head_dim} needs {cfg.head_dim // 2}")
    if not (np.isfinite(factors).all() and (factors > 0).all()):
        raise ModelFileError(f"{path}: tensor {name!r} holds values that are not positive numbers")
    return tuple(float(f) for f in factors)


def quant_name(reader: GGUFReader) -> str | None:
    """The file's quantization mix as llama.cpp names it (general.file_type: Q4_K_M, Q4_1, F16, ...);
    else the tensor type that holds the most bytes."""
    from gguf import LlamaFileType

    field = reader.fields.get("general.file_type")
    try:
        return LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")
    except (AttributeError, TypeError, ValueError):
        size: dict[str, int] = {}
        for t in reader.tensors:
            size[t.tensor_type.name] = size.get(t.tensor_type.name, 0) + int(t.n_bytes)
        return max(size, key=size.get) if size else None
