"""Hugging Face checkpoint directory (config.json + safetensors) -> (ModelConfig, Params).

The directory holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json`. Files are memory-mapped through `safetensors.safe_open` and read
one tensor at a time: each tensor is copied to the device (optionally quantized first) and its
host copy dropped, so host memory stays near the size of the final params. Matrices keep their
(out, in) orientation and their file dtype (bf16 stays bf16); 1-D norms and biases become float32.

What differs from a GGUF of the same model is settled here, so the forward pass is shared:
Hugging Face checkpoints rotate rope "halves" for every architecture, and Gemma stores its norm
weights without the +1 its RMSNorm adds (x * (1 + w)), which is added at load.

config.json is read by `hf_config`, and the weight files' headers are checked against it by
`hf_weights` before any weight is read; this module streams the weights and re-exports both.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from tqdm.auto import tqdm

from rjax.loading.loaders.errors import check_finite
from rjax.loading.loaders.fields import BIAS_FIELDS, NORM_FIELDS, assemble_params
from rjax.loading.loaders.hf_config import (CONFIG_FILE, SUPPORTED_MODEL_TYPES, checkpoint_config, config_from_hf,
                                            read_hf_config)
from rjax.loading.loaders.hf_weights import (INDEX_FILE, SINGLE_FILE, open_safetensors, read_headers, tensor_plan,
                                             weight_files)
from rjax.math.config import ModelConfig
from rjax.math.params import Params
from gguf_blocks.qtensor import QTensor
from gguf_blocks.quantize import quantize as quantize_blocks  # load_hf_dir's `quantize` argument is a type name

__all__ = ["CONFIG_FILE", "INDEX_FILE", "QUANTIZE_TYPES", "SINGLE_FILE", "SUPPORTED_MODEL_TYPES", "config_from_hf",
           "describe_hf_dir", "load_hf_dir", "read_hf_config", "weight_files"]

QUANTIZE_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k")
# Weights whose rows do not split into the requested type's blocks get this type instead
# (llama.cpp's choice for Q4_K); a row length that splits into no 32-blocks stays dense.
_QUANTIZE_FALLBACK = {QType.Q4_K: QType.Q5_0}

# Host memory bounds while loading: a tensor is read this many bytes of rows at a time, and a
# file's memory map is re-opened after this many bytes (see _FileReader).
_CHUNK_BYTES = 64 << 20
_REMAP_BYTES = 64 << 20
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4,
             "I64": 8, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _quantize_type(quantize: str | None) -> QType | None:
    if quantize is None:
        return None
    if str(quantize).lower() not in QUANTIZE_TYPES:
        raise ValueError(f"quantize={quantize!r} is not supported; supported: {', '.join(QUANTIZE_TYPES)}")
    return QType[str(quantize).upper()]


class _FileReader:
    """Row ranges of one safetensors file's tensors, through a memory map that is re-opened after
    every _REMAP_BYTES read: unmapping drops the file pages reading touched from this process's
    resident set, which would otherwise grow to the size of the file."""

    def __init__(self, file: Path):
        self.file, self.handle, self.read = file, None, 0

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        if self.handle is None or self.read >= _REMAP_BYTES:
            self.handle, self.read = open_safetensors(self.file), 0
        out = self.handle.get_slice(name)[start:stop]
        self.read += out.nbytes
        return out

    def close(self):
        self.handle = None


@functools.partial(jax.jit, donate_argnums=0)
def _write_rows(buffer: jax.Array, rows: jax.Array, start) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(buffer, rows, start, axis=0)


def _convert(host: np.ndarray, field: str, gemma: bool, qtype: QType | None, name: str):
    """Host rows of one tensor -> what the params hold (on host still): float32 norms (+1 for
    Gemma) and biases; matrices as stored, or quantized when their rows fit the type's blocks."""
    if field in NORM_FIELDS:
        w = host.astype(np.float32)
        return w + 1.0 if gemma else w  # Gemma's RMSNorm multiplies by (1 + w)
    if field in BIAS_FIELDS:
        return host.astype(np.float32)
    if qtype is not None:
        for t in (qtype, _QUANTIZE_FALLBACK.get(qtype)):
            if t is not None and host.shape[-1] % GGML_QUANT_SIZES[t][0] == 0:
                return quantize_blocks(host, t, name)
    return host


def _load_tensor(reader: _FileReader, name: str, shape: tuple[int, ...], itemsize: int, convert):
    """One tensor onto the device, read _CHUNK_BYTES of rows at a time into a preallocated device
    buffer that each write donates, so the host holds one chunk at a time and the device never
    holds two copies of the tensor."""
    step = max(1, _CHUNK_BYTES // max(1, math.prod(shape[1:]) * itemsize))

    def rows(start, stop):
        host = reader.rows(name, start, stop)
        check_finite(reader.file, name, host)
        return host

    if step >= shape[0]:
        part = convert(rows(0, shape[0]))
        if isinstance(part, QTensor):
            return QTensor(jax.tree.map(jax.device_put, part.planes), part.qtype, part.shape)
        return jax.device_put(part)
    planes = qtype = None
    for start in range(0, shape[0], step):
        part = convert(rows(start, min(start + step, shape[0])))
        leaves = part.planes if isinstance(part, QTensor) else part
        if planes is None:
            qtype = part.qtype if isinstance(part, QTensor) else None
            planes = jax.tree.map(lambda a: jnp.zeros((shape[0], *a.shape[1:]), a.dtype), leaves)
        planes = jax.tree.map(lambda buf, a: _write_rows(buf, jax.device_put(a), start), planes, leaves)
        del part, leaves
    return planes if qtype is None else QTensor(planes, qtype, shape)


def load_hf_dir(path: str | os.PathLike, *, progress: bool = True, quantize: str | None = None
                ) -> tuple[ModelConfig, Params]:
    """A Hugging Face checkpoint directory -> (config, params on the default device).

    quantize: None keeps every weight in its file dtype; "q8_0", "q4_0", "q4_1", "q5_0", "q5_1" or
    "q4_k" quantizes the 2-D weights (embedding and head included) while loading. A weight whose
    row length is not a multiple of the type's block gets the fallback type (q4_k -> q5_0) or, if
    that does not fit either, stays dense.
    """
    path = Path(path)
    qtype = _quantize_type(quantize)
    model_type, cfg = checkpoint_config(path)
    files = weight_files(path)
    tensors = read_headers(files)
    plan = tensor_plan(cfg, model_type, tensors, path)
    gemma = model_type == "gemma3_text"

    layers: list[dict] = [dict() for _ in range(cfg.n_layers)]
    top: dict = {}
    bar = tqdm(total=len(plan), desc="loading tensors", unit="tensor", disable=not progress, leave=False)
    for file in files:
        reader = _FileReader(file)
        for name, (f, dtype, shape) in tensors.items():  # in file order
            if f != file or name not in plan:
                continue
            layer, field = plan[name]
            # the router and the experts stay in their file dtype: the mixture runs as plain XLA products
            dense = field == "router" or "." in field
            convert = functools.partial(_convert, field=field, gemma=gemma, qtype=None if dense else qtype, name=name)
            w = _load_tensor(reader, name, shape, _ITEMSIZE[dtype], convert)
            if "." in field:  # one expert's weight: stacked below
                base, expert = field.split(".")
                layers[layer].setdefault(base, {})[int(expert)] = w
            else:
                (top if layer is None else layers[layer])[field] = w
            bar.update()
        reader.close()
    bar.close()
    for layer in layers:
        for field, experts in layer.items():
            if isinstance(experts, dict):
                layer[field] = jnp.stack([experts[e] for e in range(len(experts))])
    return cfg, assemble_params(cfg, top, layers)


def describe_hf_dir(path: str | os.PathLike) -> dict:
    """What a checkpoint directory holds, from config.json and the safetensors headers (no weights
    are read): the same keys as `rjax.cli.info.model_info` gives for a GGUF, plus `model_type`."""
    path = Path(path)
    model_type, cfg = checkpoint_config(path)
    files = weight_files(path)
    headers = read_headers(files)
    tensor_plan(cfg, model_type, headers, path)
    tensors = [dict(name=n, type=dtype, shape=list(shape), bytes=math.prod(shape) * _ITEMSIZE.get(dtype, 0))
               for n, (_, dtype, shape) in headers.items()]
    count, size = collections.Counter(), collections.Counter()
    for t in tensors:
        count[t["type"]] += 1
        size[t["type"]] += t["bytes"]
    config = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in ("layer_windows", "layer_rope_theta", "layer_rope_linear", "rope_freq_factors")}
    config["layer_windows"] = sorted({w for w in cfg.layer_windows if w}) or None
    return dict(path=str(path), file_bytes=sum(f.stat().st_size for f in files), architecture=cfg.arch,
                model_type=model_type, config=config,
                parameters=sum(math.prod(t["shape"]) for t in tensors),
                tensor_bytes=sum(t["bytes"] for t in tensors),
                tensor_types={k: dict(count=count[k], bytes=size[k]) for k in sorted(count)},
                tensors=tensors)
