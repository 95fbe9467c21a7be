"""`rjax info`: what a model file holds, read from its header without loading weights."""
from __future__ import annotations

import collections
import dataclasses
import math
from pathlib import Path


def model_info(model: str) -> dict:
    from rjax.catalog import resolve_model
    from rjax.loaders.gguf import config_from_reader, open_gguf

    path = Path(resolve_model(model))
    if path.is_dir():
        from rjax.loaders.safetensors import describe_hf_dir

        return describe_hf_dir(path)
    reader = open_gguf(path)
    cfg = config_from_reader(reader, path)
    tensors = [dict(name=t.name, type=t.tensor_type.name, shape=[int(s) for s in reversed(t.shape.tolist())],
                    bytes=int(t.n_bytes)) for t in reader.tensors]
    by_type = collections.Counter(t["type"] for t in tensors)
    bytes_by_type = collections.Counter()
    for t in tensors:
        bytes_by_type[t["type"]] += t["bytes"]
    per_layer = ("layer_windows", "layer_rope_theta", "layer_rope_linear", "rope_freq_factors")
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in per_layer}
    config["layer_windows"] = sorted({w for w in cfg.layer_windows if w}) or None
    return dict(path=str(path), file_bytes=path.stat().st_size, architecture=cfg.arch, config=config,
                parameters=sum(math.prod(t["shape"]) for t in tensors),
                tensor_bytes=sum(t["bytes"] for t in tensors),
                tensor_types={k: dict(count=by_type[k], bytes=bytes_by_type[k]) for k in sorted(by_type)},
                tensors=tensors)


def format_info(info: dict) -> str:
    c = info["config"]
    lines = [
        f"{info['path']}",
        f"  architecture   {info['architecture']}",
        f"  layers         {c['n_layers']}   hidden {c['d_model']}   ffn {c['d_ff']}",
        f"  heads          {c['n_heads']} query / {c['n_kv_heads']} kv, head dim {c['head_dim']}",
        f"  vocab          {c['vocab_size']}   context {c['context_length']}",
        f"  rope           base {c['rope_theta']:g}, {c['rope_pairing']}"
        + (f", sliding window {c['layer_windows']}" if c.get("layer_windows") else ""),
        f"  parameters     {info['parameters']:,}",
        f"  tensor bytes   {info['tensor_bytes']:,} (file {info['file_bytes']:,})",
        "  tensor types   " + ", ".join(f"{k} ×{v['count']} ({v['bytes'] / 1e6:.1f} MB)"
                                       for k, v in info["tensor_types"].items()),
        "  tensors:",
    ]
    lines += [f"    {t['name']:40} {t['type']:6} {'x'.join(map(str, t['shape']))}" for t in info["tensors"]]
    return "\n".join(lines)


def model_plan(model: str, *, rows: int = 1, tokens: int = 1, gpu: bool = True, paged: bool = False) -> str:
    """The fusion plan (rjax.plan) of one forward pass of `rows` sequences x `tokens` tokens
    over the model as a GPU (or CPU) load lays it out, in bfloat16 on a GPU, float32 on a CPU."""
    import jax.numpy as jnp

    from rjax.loaders import load
    from rjax.plan import plan_for

    m = load(model, progress=False, fuse=gpu, gpu_layout=gpu)
    dtype = jnp.bfloat16 if gpu else jnp.float32
    return str(plan_for(m.config, m.params, rows, tokens, dtype, paged=paged, slots=paged, gpu=gpu))
