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

import collections
import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from gguf import GGUFReader
from tqdm.auto import tqdm

from rjax.loading.loaders.errors import ModelFileError, check_finite, listing
from rjax.loading.loaders.fields import BIAS_FIELDS, NORM_FIELDS, assemble_params, expected_shape, missing_layer_fields
from rjax.math.config import ModelConfig
# the header lives apart, without jax, so that `rjax info` reads it without starting the engine
from rjax.loading.loaders.gguf_header import (GGUF_MAGIC, config_from_metadata, config_from_reader,  # noqa: F401
                                              metadata, open_gguf)
from rjax.loading.programs import device_program
from rjax.math.params import Params
from gguf_blocks import formats, reference
from gguf_blocks.qtensor import QTensor


class TensorFileError(ModelFileError, formats.TensorFormatError):
    """A tensor of the file whose type, shape or size cannot be loaded (still a TensorFormatError,
    which callers of `gguf_blocks.formats` catch)."""


# One small program per type and shape (eager slicing would run one per operation), stored like
# the engine's: a warm start neither traces nor lowers it, which the loading threads would do
# one at a time (they hold Python's lock while they trace).
_planes_from_bytes = device_program(formats.planes_from_bytes, static_argnames=("qtype",))


def _to_device(w, data):
    """Host weight (numpy array, or QTensor of plane views of `data`) -> the same on the default
    device, as a plain transfer (`jnp.asarray` would compile a small program for every new
    shape). A quantized weight's block bytes travel in one piece, straight from the mapped
    file, and are split into planes on the device: no host copy, one transfer instead of one
    per plane."""
    if isinstance(w, QTensor):
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        return QTensor(_planes_from_bytes(w.qtype, jax.device_put(raw.reshape(w.planes[0].shape[0], -1))),
                       w.qtype, w.shape)
    return jax.device_put(w)


LOAD_THREADS = 8  # tensors checked and sent at a time (each thread's numpy and transfers release the GIL)


def stack_experts(w: QTensor) -> QTensor:
    """A stacked expert tensor (E, out, in) kept packed: its planes (E * out, blocks, ...) viewed
    as (E, out, blocks, ...). One QTensor with a leading expert axis rather than E QTensors:
    the routed product gathers the chosen experts' blocks with one take along that axis, and
    tensor parallel splits every expert's rows (or blocks) with one slice of each plane."""
    E, out = w.shape[0], w.shape[1]
    return QTensor(jax.tree.map(lambda p: p.reshape(E, out, *p.shape[1:]), w.planes), w.qtype, w.shape)


LAYER_TENSORS = {
    "attn_norm": "attn_norm", "attn_qkv": "wqkv", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
    "ffn_norm": "ffn_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down",
    "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
    "post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_ffn_norm",
    "ffn_gate_inp": "router", "ffn_gate_exps": "w_gate_exps", "ffn_up_exps": "w_up_exps",
    "ffn_down_exps": "w_down_exps",
}
EXPERT_FIELDS = frozenset({"router", "w_gate_exps", "w_up_exps", "w_down_exps"})
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
    if cfg.arch == "phi3" and field == "w_up":  # Phi-3's ffn_up holds gate and up stacked
        field = "w_gate_up"
    if field in EXPERT_FIELDS and not cfg.n_experts:
        raise ModelFileError(f"{path}: tensor {name!r} belongs to a mixture of experts, but the file has no "
                             f"{cfg.arch}.expert_count")
    return int(parts[1]), field


def _load_tensor(t, cfg: ModelConfig, path, on_device: bool):
    """One tensor of the file -> (layer or None, params field, weight), or None where the engine
    does not use it; every check of the tensor against the config is made here."""
    place = _place(t.name, cfg, path)
    if place is None:
        return None
    layer, field = place
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))
    if field == "lm_head" and cfg.tie_embeddings:
        return None
    try:
        formats.resolve_type(t.tensor_type, t.name)
    except formats.TensorFormatError as e:
        raise TensorFileError(f"{path}: {e}") from e
    want = expected_shape(cfg, field)
    if shape != want:
        sizes = (f"{cfg.n_experts} experts of feed-forward {cfg.expert_d_ff} ({cfg.arch}.expert_count, "
                 f"{cfg.arch}.expert_feed_forward_length)" if field in EXPERT_FIELDS else
                 f"heads {cfg.n_heads}/{cfg.n_kv_heads} of {cfg.head_dim}, feed-forward {cfg.d_ff}")
        raise ModelFileError(f"{path}: tensor {t.name!r} has shape {list(shape)}, but the metadata implies "
                             f"{list(want)} (embedding {cfg.d_model}, {sizes}, vocabulary {cfg.vocab_size})")
    try:
        views = on_device and field not in EXPERT_FIELDS  # the bytes move whole (`_to_device`)
        host = formats.to_host_weight(t.name, t.tensor_type, t.data, shape, views=views)
    except formats.TensorFormatError as e:
        raise TensorFileError(f"{path}: {e}") from e
    if field in NORM_FIELDS | BIAS_FIELDS and isinstance(host, QTensor):
        raise ModelFileError(f"{path}: tensor {t.name!r} is {host.qtype.name}; norms and biases must be "
                             "F32, F16 or BF16")
    check_finite(path, t.name, host)
    if field == "router" and isinstance(host, QTensor):  # a small matrix the routing reads whole, in float
        host = np.asarray(reference.dequantize(host))
    w = _to_device(host, t.data) if on_device else host
    return layer, field, stack_experts(w) if field in EXPERT_FIELDS and isinstance(w, QTensor) else w


def load_params(reader: GGUFReader, cfg: ModelConfig, progress: bool = True, on_device: bool = True) -> Params:
    """on_device False: leave the weights in host memory (views of the mapped file where the
    layout allows), for a caller that puts them onto devices itself (a model split over several)."""
    path = reader.data.filename if hasattr(reader.data, "filename") else "<gguf>"
    layers: list[dict] = [dict() for _ in range(cfg.n_layers)]
    top: dict = {}
    # Splitting blocks into planes, the finiteness checks and the transfers are numpy and XLA
    # work that releases the interpreter lock: a few tensors at a time in threads, in file
    # order, so that the first bad tensor of the file is the one reported and host memory
    # holds only the window's copies.
    workers = max(1, min(LOAD_THREADS, os.cpu_count() or 1))
    tensors = iter(reader.tensors)
    with ThreadPoolExecutor(workers) as pool, tqdm(total=len(reader.tensors), desc="loading tensors", unit="tensor",
                                                   disable=not progress, leave=False) as bar:
        window = collections.deque(pool.submit(_load_tensor, t, cfg, path, on_device)
                                   for t in itertools.islice(tensors, 2 * workers))
        while window:
            loaded = window.popleft().result()
            if (t := next(tensors, None)) is not None:
                window.append(pool.submit(_load_tensor, t, cfg, path, on_device))
            bar.update()
            if loaded is not None:
                layer, field, weight = loaded
                (top if layer is None else layers[layer])[field] = weight
    missing = [n for n, f in TOP_TENSORS.items() if f not in top and (f != "lm_head" or not cfg.tie_embeddings)]
    inverse = {v: k for k, v in LAYER_TENSORS.items()} | {"w_gate_up": "ffn_up"}
    for i, layer in enumerate(layers):
        missing += [f"blk.{i}.{inverse[f]}" for f in missing_layer_fields(cfg, layer)]
    if missing:
        raise ModelFileError(f"{path}: missing tensors: {listing(missing, 8)}")
    return assemble_params(cfg, top, layers)


def load_gguf(path: str | os.PathLike, progress: bool = True, on_device: bool = True):
    """-> (config, params, reader). The reader stays open (memory-mapped) for the tokenizer."""
    reader = open_gguf(path)
    cfg = config_from_reader(reader, path)
    return cfg, load_params(reader, cfg, progress, on_device), reader
