"""GGUF file -> (ModelConfig, Params, GGUFReader), memory-mapped through the `gguf` package.

Quantized tensors stay in their packed blocks (split into planes, see gguf_blocks.formats) all
the way to the device; no full-precision copy of the weights is made.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGUFReader
from tqdm.auto import tqdm

from rjax.config import ModelConfig, RopeScaling, SUPPORTED_ARCHITECTURES
from rjax.model import LayerParams, Params
from gguf_blocks import formats
from gguf_blocks.qtensor import QTensor

GGUF_MAGIC = b"GGUF"


class ModelFileError(ValueError):
    """A model file that cannot be used: the message names the file and what is wrong."""


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
        reader = GGUFReader(path, "r")
    except Exception as e:  # the gguf parser raises many types on a damaged header
        raise ModelFileError(f"{path} is truncated or corrupt ({path.stat().st_size:,} bytes): the GGUF reader "
                             f"failed with {type(e).__name__}: {e}") from e
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelFileError(f"{path} is truncated: tensor {t.name!r} needs bytes up to {end:,} "
                                 f"but the file has {size:,}")
    return reader


def metadata(reader: GGUFReader) -> dict:
    """All scalar/string/array metadata fields except the big tokenizer arrays, as Python values."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
                "tokenizer.ggml.model", "tokenizer.ggml.pre") and len(field.data) > 1:
            continue
        try:
            out[key] = field.contents()
        except Exception:  # noqa: BLE001 - unusual field types are not needed for config
            continue
    return out


def config_from_metadata(meta: dict, path: str | os.PathLike = "<gguf>") -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"{path}: unsupported architecture {arch!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def get(key, default=None, required=True):
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if required and default is None:
            raise ModelFileError(f"{path}: missing metadata key {full!r}")
        return default

    n_layers = int(get("block_count"))
    d_model = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    n_kv = int(n_kv[0] if isinstance(n_kv, list) else n_kv)
    head_dim = int(get("attention.key_length", d_model // n_heads))
    d_ff = get("feed_forward_length")
    d_ff = int(d_ff[0] if isinstance(d_ff, list) else d_ff)
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens", [])) or None
    rope_theta = float(get("rope.freq_base", 10000.0))
    scaling = None
    scaling_type = get("rope.scaling.type", "", required=False)
    if scaling_type not in ("", "none", "linear", "llama3"):
        raise ModelFileError(f"{path}: rope scaling type {scaling_type!r} ({arch}.rope.scaling.type) is not "
                             "supported; supported: none, linear, llama3")
    # linear scaling divides positions by the factor (gemma3: on its global layers only)
    linear = float(get("rope.scaling.factor", 1.0, required=False)) if scaling_type == "linear" else 1.0
    if scaling_type == "llama3" or f"{arch}.rope.scaling.low_freq_factor" in meta:
        scaling = RopeScaling(float(get("rope.scaling.factor")), float(get("rope.scaling.low_freq_factor", 1.0)),
                              float(get("rope.scaling.high_freq_factor", 4.0)),
                              int(get("rope.scaling.original_context_length")))
    common = dict(arch=arch, n_layers=n_layers, d_model=d_model, d_ff=d_ff, n_heads=n_heads,
                  n_kv_heads=n_kv, head_dim=head_dim, vocab_size=int(vocab) if vocab else 0,
                  context_length=int(get("context_length")),
                  rms_eps=float(get("attention.layer_norm_rms_epsilon")), rope_theta=rope_theta,
                  rope_scaling=scaling)
    window = get("attention.sliding_window", 0, required=False)
    if arch == "llama":
        return ModelConfig(**common, rope_pairing="pairs", layer_rope_linear=(linear,) * n_layers,
                           layer_windows=(int(window) or None,) * n_layers if window else ())
    if arch == "qwen2":
        return ModelConfig(**common, rope_pairing="halves", qkv_bias=True, layer_rope_linear=(linear,) * n_layers,
                           layer_windows=(int(window) or None,) * n_layers if window else ())
    # gemma3: five sliding-window layers (rope base 10k) then one global layer (rope base from the file),
    # unless the file says otherwise: a pattern n (every n-th layer global) or one flag per layer
    # (true: sliding window), and the sliding layers' rope base
    pattern = get("attention.sliding_window_pattern", 6, required=False)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ModelFileError(f"{path}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                                 f"for {n_layers} layers")
        is_global = tuple(not bool(p) for p in pattern)
    else:
        is_global = tuple(int(pattern) > 0 and (i + 1) % int(pattern) == 0 for i in range(n_layers))  # 0: none
    local_theta = float(get("rope.freq_base_swa", 10000.0, required=False))
    # llama.cpp's rule: the 62-layer (27B) model scales queries by its d_model / n_heads (Gemma's
    # query_pre_attn_scalar), the others by head_dim.
    attn_scale = (d_model / n_heads) ** -0.5 if n_layers == 62 else 0.0
    return ModelConfig(**common, rope_pairing="halves", qk_norm=True, post_norms=True,
                       activation="gelu_tanh", embed_scale=math.sqrt(d_model), attn_scale=attn_scale,
                       layer_windows=tuple(None if g else int(window) for g in is_global),
                       layer_rope_theta=tuple(rope_theta if g else local_theta for g in is_global),
                       layer_rope_linear=tuple(linear if g else 1.0 for g in is_global))


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


def load_params(reader: GGUFReader, cfg: ModelConfig, progress: bool = True) -> Params:
    path = reader.data.filename if hasattr(reader.data, "filename") else "<gguf>"
    layers: list[dict] = [dict() for _ in range(cfg.n_layers)]
    top: dict = {}
    for t in tqdm(reader.tensors, desc="loading tensors", unit="tensor", disable=not progress, leave=False):
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        w = _to_device(formats.to_host_weight(t.name, t.tensor_type, t.data, shape))
        parts = t.name.split(".")
        if parts[0] == "blk":
            key = ".".join(parts[2:-1]) if parts[-1] == "weight" else ".".join(parts[2:])
            field = LAYER_TENSORS.get(key)
            if field is None:
                continue  # tensors this engine does not use (e.g. rope_freqs handled via config)
            layers[int(parts[1])][field] = w
        else:
            top[t.name] = w
    missing = ["token_embd.weight"] if "token_embd.weight" not in top else []
    if "output_norm.weight" not in top:
        missing.append("output_norm.weight")
    required = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
    if cfg.qkv_bias:
        required += ["bq", "bk", "bv"]
    if cfg.qk_norm:
        required += ["q_norm", "k_norm"]
    if cfg.post_norms:
        required += ["post_attn_norm", "post_ffn_norm"]
    inverse = {v: k for k, v in LAYER_TENSORS.items()}
    for i, layer in enumerate(layers):
        missing += [f"blk.{i}.{inverse[f]}" for f in required if f not in layer]
    if missing:
        raise ModelFileError(f"{path}: missing tensors: {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return Params(embed=top["token_embd.weight"], layers=tuple(LayerParams(**l) for l in layers),
                  final_norm=top["output_norm.weight"], lm_head=top.get("output.weight"))


def config_from_reader(reader: GGUFReader, path: str | os.PathLike = "<gguf>") -> ModelConfig:
    cfg = config_from_metadata(metadata(reader), path)
    if not cfg.vocab_size:  # most files carry it only as the embedding's row count
        emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if emb is None:
            raise ModelFileError(f"{path}: missing tensor 'token_embd.weight'")
        cfg = dataclasses.replace(cfg, vocab_size=int(emb.shape[1]))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    if tied != cfg.tie_embeddings:  # the file says it by having (or not) a separate head
        cfg = dataclasses.replace(cfg, tie_embeddings=tied)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # llama.cpp's form of Llama-3 rope scaling: per-frequency divisors
        factors = np.asarray(freqs.data, np.float32).reshape(-1)
        if factors.size != cfg.head_dim // 2:
            raise ModelFileError(f"{path}: tensor 'rope_freqs.weight' has {factors.size} values; "
                                 f"head_dim {cfg.head_dim} needs {cfg.head_dim // 2}")
        cfg = dataclasses.replace(cfg, rope_freq_factors=tuple(float(f) for f in factors), rope_scaling=None)
    return cfg


def load_gguf(path: str | os.PathLike, progress: bool = True):
    """-> (config, params, reader). The reader stays open (memory-mapped) for the tokenizer."""
    reader = open_gguf(path)
    cfg = config_from_reader(reader, path)
    return cfg, load_params(reader, cfg, progress), reader
