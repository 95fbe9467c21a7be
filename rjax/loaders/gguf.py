"""GGUF file -> (ModelConfig, Params, GGUFReader), memory-mapped through the `gguf` package.

Quantized tensors stay in their packed blocks (split into planes, see gguf_blocks.formats) all
the way to the device; no full-precision copy of the weights is made.

Nothing the file says is trusted before it is checked: every read of the header is bounded by
the file's size, metadata values are checked for type and range before a config is sized from
them, each tensor's shape is checked against the config, and weights (float values, and the
float16 scales of quantized blocks) are checked for NaN and Inf. What fails is a ModelFileError
that names the file and the key or tensor.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from tqdm.auto import tqdm

from rjax.config import ModelConfig, RopeScaling, SUPPORTED_ARCHITECTURES
from rjax.loaders.errors import MAX_CONTEXT, MAX_DIM, MAX_LAYERS, MAX_VOCAB, ModelFileError, check_finite, listing
from rjax.loaders.fields import BIAS_FIELDS, NORM_FIELDS, assemble_params, expected_shape, required_layer_fields
from rjax.model import Params
from gguf_blocks import formats
from gguf_blocks.qtensor import QTensor

GGUF_MAGIC = b"GGUF"
GGML_MAX_DIMS = 4  # llama.cpp's limit on a tensor's dimensions

# Fewest bytes one array item of each type takes: an array's count is checked against this.
_MIN_ITEM_BYTES = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12,
                   **{t: np.dtype(d).itemsize for t, d in GGUFReader.gguf_scalar_to_np.items()}}


class TensorFileError(ModelFileError, formats.TensorFormatError):
    """A tensor of the file whose type, shape or size cannot be loaded (still a TensorFormatError,
    which callers of `gguf_blocks.formats` catch)."""


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
        np_type = self.gguf_scalar_to_np.get(item_type)
        if np_type is None:  # strings and nested arrays: item by item, each read bounded
            return super()._get_field_parts(orig_offs, raw_type)
        items = self._get(orig_offs + 12, np_type, n)
        return 12 + int(items.nbytes), [raw_item_type, count, items], [2], [GGUFValueType.ARRAY, item_type]

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


def open_gguf(path: str | os.PathLike) -> GGUFReader:
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
        return _BoundedReader(path, "r")
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


def config_from_metadata(meta: dict, path: str | os.PathLike = "<gguf>") -> ModelConfig:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"{path}: unsupported architecture {arch!r:.80} (general.architecture); "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
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
    try:
        if arch == "llama":
            return ModelConfig(**common, rope_pairing="pairs", layer_rope_linear=(linear,) * n_layers,
                               layer_windows=(window or None,) * n_layers if window else ())
        if arch == "qwen2":
            return ModelConfig(**common, rope_pairing="halves", qkv_bias=True, layer_rope_linear=(linear,) * n_layers,
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


def _to_device(w):
    """Host weight (numpy array, or QTensor of numpy planes) -> the same on the default device."""
    if isinstance(w, QTensor):
        return QTensor(jax.tree.map(jnp.asarray, w.planes), w.qtype, w.shape)
    return jnp.asarray(w)


LAYER_TENSORS = {
    "attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
    "ffn_norm": "ffn_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down",
    "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
    "post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_ffn_norm",
}
# the full name after `blk.N.`: "attn_q.weight", "attn_q.bias", ...
_LAYER_NAMES = {(k if k.endswith(".bias") else k + ".weight"): f for k, f in LAYER_TENSORS.items()}
TOP_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}


def _place(name: str, cfg: ModelConfig, path) -> tuple[int | None, str] | None:
    """A tensor name -> (layer or None, params field), or None for tensors the engine does not use
    (e.g. rope_freqs, read into the config)."""
    if name in TOP_TENSORS:
        return None, TOP_TENSORS[name]
    parts = name.split(".", 2)
    field = _LAYER_NAMES.get(parts[2]) if len(parts) == 3 and parts[0] == "blk" else None
    if field is None:
        return None
    if not parts[1].isdigit() or int(parts[1]) >= cfg.n_layers:
        raise ModelFileError(f"{path}: tensor {name!r} names block {parts[1]!r}, but the file has "
                             f"{cfg.n_layers} blocks ({cfg.arch}.block_count)")
    return int(parts[1]), field


def load_params(reader: GGUFReader, cfg: ModelConfig, progress: bool = True, on_device: bool = True) -> Params:
    """on_device False: leave the weights in host memory (views of the mapped file where the
    layout allows), for a caller that puts them onto devices itself (a model split over several)."""
    path = reader.data.filename if hasattr(reader.data, "filename") else "<gguf>"
    layers: list[dict] = [dict() for _ in range(cfg.n_layers)]
    top: dict = {}
    for t in tqdm(reader.tensors, desc="loading tensors", unit="tensor", disable=not progress, leave=False):
        place = _place(t.name, cfg, path)
        if place is None:
            continue
        layer, field = place
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        if field == "lm_head" and cfg.tie_embeddings:
            continue
        try:
            formats.resolve_type(t.tensor_type, t.name)
        except formats.TensorFormatError as e:
            raise TensorFileError(f"{path}: {e}") from e
        want = expected_shape(cfg, field)
        if shape != want:
            raise ModelFileError(f"{path}: tensor {t.name!r} has shape {list(shape)}, but the metadata implies "
                                 f"{list(want)} (embedding {cfg.d_model}, heads {cfg.n_heads}/{cfg.n_kv_heads} of "
                                 f"{cfg.head_dim}, feed-forward {cfg.d_ff}, vocabulary {cfg.vocab_size})")
        try:
            host = formats.to_host_weight(t.name, t.tensor_type, t.data, shape)
        except formats.TensorFormatError as e:
            raise TensorFileError(f"{path}: {e}") from e
        if field in NORM_FIELDS | BIAS_FIELDS and isinstance(host, QTensor):
            raise ModelFileError(f"{path}: tensor {t.name!r} is {host.qtype.name}; norms and biases must be "
                                 "F32, F16 or BF16")
        check_finite(path, t.name, host)
        (top if layer is None else layers[layer])[field] = _to_device(host) if on_device else host
    missing = [n for n, f in TOP_TENSORS.items() if f not in top and (f != "lm_head" or not cfg.tie_embeddings)]
    required = required_layer_fields(cfg)
    inverse = {v: k for k, v in LAYER_TENSORS.items()}
    for i, layer in enumerate(layers):
        missing += [f"blk.{i}.{inverse[f]}" for f in required if f not in layer]
    if missing:
        raise ModelFileError(f"{path}: missing tensors: {listing(missing, 8)}")
    return assemble_params(cfg, top, layers)


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
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # llama.cpp's form of Llama-3 rope scaling: per-frequency divisors
        if freqs.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            raise ModelFileError(f"{path}: tensor 'rope_freqs.weight' is {freqs.tensor_type.name}; expected F32")
        factors = np.asarray(freqs.data, np.float32).reshape(-1)
        if factors.size != cfg.head_dim // 2:
            raise ModelFileError(f"{path}: tensor 'rope_freqs.weight' has {factors.size} values; "
                                 f"head_dim {cfg.head_dim} needs {cfg.head_dim // 2}")
        if not (np.isfinite(factors).all() and (factors > 0).all()):
            raise ModelFileError(f"{path}: tensor 'rope_freqs.weight' holds values that are not positive numbers")
        cfg = dataclasses.replace(cfg, rope_freq_factors=tuple(float(f) for f in factors), rope_scaling=None)
    return cfg


def load_gguf(path: str | os.PathLike, progress: bool = True, on_device: bool = True):
    """-> (config, params, reader). The reader stays open (memory-mapped) for the tokenizer."""
    reader = open_gguf(path)
    cfg = config_from_reader(reader, path)
    return cfg, load_params(reader, cfg, progress, on_device), reader
