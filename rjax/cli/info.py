"""`rjax info`: what a model file holds, read from its header without loading weights or starting jax.

A summary comes first (architecture, parameters, the quant mix with bytes per type, context, chat
template, and the memory plan for the backend present), the tensors in natural order (blk.2
before blk.10) only when asked for. On a machine without an accelerator plugin for jax the
backend is the CPU and jax is not imported at all.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import math
import re
from importlib.metadata import entry_points
from pathlib import Path


def present_backend() -> str:
    """jax's default backend ("cpu", "gpu", "tpu"). jax finds accelerators through plugins (the
    `jax_plugins` entry points and namespace, or libtpu); where none is installed it can only be
    the CPU, which is then answered without importing jax."""
    if (not entry_points(group="jax_plugins") and importlib.util.find_spec("jax_plugins") is None
            and importlib.util.find_spec("libtpu") is None):
        return "cpu"
    import jax

    return jax.default_backend()


def natural_key(name: str) -> list:
    """Sort key that orders the numbers inside names by value: blk.2 before blk.10."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name))]


def model_info(model: str, *, backend: str | None = None, home=None) -> dict:
    """The header summary of a catalog name, `.gguf` file or Hugging Face directory, as plain
    JSON-able values. `backend`: the memory plan's ("cpu" or "gpu"; default the one present)."""
    from rjax.loading.catalog import resolve_model

    path = Path(resolve_model(model, home))
    if path.is_dir():
        from rjax.loading.loaders.hf_config import checkpoint_config
        from rjax.loading.loaders.safetensors import describe_hf_dir

        info, (_, cfg) = describe_hf_dir(path), checkpoint_config(path)
        info["name"] = None  # a GGUF's general.name; a checkpoint's config does not carry one
        info["chat_template"] = (path / "chat_template.jinja").is_file() or _hf_has_template(path)
        info["quant"] = max(info["tensor_types"], key=lambda k: info["tensor_types"][k]["bytes"])
    else:
        info, cfg = _gguf_info(path)
    info["tensors"] = sorted(info["tensors"], key=lambda t: natural_key(t["name"]))
    info["memory"] = memory_summary(cfg, info["tensor_bytes"], backend or present_backend())
    return info


def _hf_has_template(path: Path) -> bool:
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _gguf_info(path: Path):
    from rjax.loading.loaders.gguf_header import config_from_reader, metadata, open_gguf, quant_name

    reader = open_gguf(path, string_arrays=False)
    cfg = config_from_reader(reader, path)
    meta = metadata(reader)
    tensors = [dict(name=t.name, type=t.tensor_type.name, shape=[int(s) for s in reversed(t.shape.tolist())],
                    bytes=int(t.n_bytes)) for t in reader.tensors]
    count, size = collections.Counter(), collections.Counter()
    for t in tensors:
        count[t["type"]] += 1
        size[t["type"]] += t["bytes"]
    per_layer = ("layer_windows", "layer_rope_theta", "layer_rope_linear", "rope_freq_factors")
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in per_layer}
    config["layer_windows"] = sorted({w for w in cfg.layer_windows if w}) or None
    name = meta.get("general.name")
    # The file's own architecture name (qwen3moe), not the family the model runs as (qwen3).
    arch = meta.get("general.architecture")
    return dict(path=str(path), file_bytes=path.stat().st_size, architecture=arch if isinstance(arch, str) else cfg.arch,
                name=name if isinstance(name, str) else None, quant=quant_name(reader), config=config,
                chat_template=isinstance(meta.get("tokenizer.chat_template"), str),
                parameters=sum(math.prod(t["shape"]) for t in tensors),
                tensor_bytes=sum(t["bytes"] for t in tensors),
                tensor_types={k: dict(count=count[k], bytes=size[k]) for k in sorted(count)},
                tensors=tensors), cfg


def memory_summary(cfg, params_bytes: int, backend: str) -> dict:
    """How the model fits on `backend`'s first device: the weights (as stored), the KV cache per
    position (float32 on the CPU, bfloat16 elsewhere) and how many sequences of the full context fit
    beside them (rjax.engine.memory.plan_memory, a contiguous cache)."""
    import numpy as np

    from rjax.engine.memory import (MemoryFitError, available_bytes, host_available_bytes, kv_bytes_per_position,
                                    plan_memory)

    kv_dtype = np.float32 if backend == "cpu" else "bf16"
    if backend == "cpu":
        available, source = host_available_bytes(), "available host memory"
    else:
        available, source = available_bytes()
    out = dict(backend=backend, kv_dtype="float32" if backend == "cpu" else "bfloat16", params_bytes=params_bytes,
               kv_bytes_per_position=kv_bytes_per_position(cfg, kv_dtype), context=cfg.context_length,
               available_bytes=int(available), source=source)
    try:
        plan = plan_memory(cfg, max_len=cfg.context_length, page_size=None, params_bytes=params_bytes,
                           dtype=kv_dtype, available=available, backend=backend)
        out.update(sequences_at_full_context=plan.n_slots, needed_bytes=plan.needed_bytes)
    except MemoryFitError as e:
        out.update(sequences_at_full_context=0, refused=str(e))
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


def active_parameters(config: dict, parameters: int) -> int:
    """The parameters one token's forward pass reads: all of them less its unchosen experts'."""
    per_expert = 3 * config["d_model"] * config["expert_d_ff"]
    return parameters - config["n_layers"] * (config["n_experts"] - config["n_experts_used"]) * per_expert


def format_info(info: dict, *, tensors: bool = False) -> str:
    c = info["config"]
    lines = [
        f"{info['path']}",
        f"  architecture   {info['architecture']}" + (f"   ({info['name']})" if info.get("name") else ""),
        f"  parameters     {info['parameters']:,}   ({info['parameters'] / 1e6:,.1f} M)",
        f"  quant          {info.get('quant')}: " + ", ".join(
            f"{k} ×{v['count']} {_mb(v['bytes'])}" for k, v in
            sorted(info["tensor_types"].items(), key=lambda kv: -kv[1]["bytes"])),
        f"  bytes          tensors {info['tensor_bytes']:,}, file {info['file_bytes']:,}",
        f"  context        {c['context_length']:,}",
        f"  chat template  {'yes' if info.get('chat_template') else 'no (a base model: use --raw)'}",
        f"  layers         {c['n_layers']}   hidden {c['d_model']}   ffn {c['d_ff']}   vocab {c['vocab_size']:,}",
        f"  heads          {c['n_heads']} query / {c['n_kv_heads']} kv, head dim {c['head_dim']}",
        *([f"  experts        {c['n_experts']}, {c['n_experts_used']} per token, ffn {c['expert_d_ff']}; "
           f"active parameters {active_parameters(c, info['parameters']):,}"] if c.get("n_experts") else []),
        f"  rope           base {c['rope_theta']:g}, {c['rope_pairing']}"
        + (f", sliding window {c['layer_windows']}" if c.get("layer_windows") else ""),
    ]
    m = info.get("memory")
    if m:
        fit = (f"{m['sequences_at_full_context']} sequence(s) of the full context fit"
               if m["sequences_at_full_context"] else "the full context does not fit in one sequence")
        lines += [f"  memory ({m['backend']})   weights {_mb(m['params_bytes'])}, KV cache "
                  f"{m['kv_bytes_per_position'] / 1e3:,.1f} kB per position ({m['kv_dtype']}, "
                  f"{_mb(m['kv_bytes_per_position'] * m['context'])} per full context); "
                  f"{_mb(m['available_bytes'])} {m['source']}: {fit}"]
    if tensors:
        lines.append(f"  tensors ({len(info['tensors'])}):")
        lines += [f"    {t['name']:40} {t['type']:6} {'x'.join(map(str, t['shape']))}" for t in info["tensors"]]
    else:
        lines.append(f"  tensors        {len(info['tensors'])} (list them with --tensors)")
    return "\n".join(lines)


def model_plan(model: str, *, rows: int = 1, tokens: int = 1, gpu: bool | None = None, paged: bool = False) -> str:
    """The fusion plan (rjax.math.plan) of one forward pass of `rows` sequences x `tokens` tokens
    over the model as a GPU (or CPU) load lays it out, in bfloat16 on a GPU, float32 on a CPU.
    `gpu` None: the backend present."""
    import jax.numpy as jnp

    from rjax.loading.loaders import load
    from rjax.math.plan import plan_for

    if gpu is None:
        gpu = present_backend() == "gpu"
    m = load(model, progress=False, fuse=gpu, gpu_layout=gpu)
    dtype = jnp.bfloat16 if gpu else jnp.float32
    return str(plan_for(m.config, m.params, rows, tokens, dtype, paged=paged, slots=paged, gpu=gpu))
