"""What a decode step must read, and how fast this device reads: the roofline that throughput is
held against. Bytes of weights (quantized planes or dense arrays) and of the KV cache per step,
the device's bandwidth (the fastest of a device-to-device copy and elementwise passes, measured
in the same run), and the ceiling they give."""
from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from gguf_blocks.qtensor import QTensor
from rjax.math.config import ModelConfig
from rjax.math.params import Params

# ---------------------------------------------------------------------------------------------
# bytes: weights, KV cache, roofline

def _leaf_bytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def weight_bytes(params: Params) -> int:
    """Bytes of every weight array (quantized planes or dense arrays) in the params."""
    return _leaf_bytes(params)


def decode_weight_bytes(cfg: ModelConfig, params: Params, batch: int) -> int:
    """Weight bytes one decode step reads: everything, except that an untied embedding table
    is only gathered from (`batch` rows of it) and a mixture's experts are read only where
    chosen (at most batch x k of the E experts per layer: the active parameters at batch 1)."""
    total = weight_bytes(params)
    if cfg.n_experts:
        experts = sum(_leaf_bytes((p.w_gate_exps, p.w_up_exps, p.w_down_exps)) for p in params.layers)
        total -= experts - experts * min(cfg.n_experts, batch * cfg.n_experts_used) // cfg.n_experts
    if params.lm_head is None:  # tied: the embedding is read in full as the LM head
        return total
    embed = _leaf_bytes(params.embed)
    return total - embed + math.ceil(embed / cfg.vocab_size) * min(batch, cfg.vocab_size)


def kv_bytes_per_sequence(cfg: ModelConfig, context: float, itemsize: int) -> float:
    """K and V bytes a decode step reads for one sequence holding `context` positions."""
    per_position = 2 * cfg.n_kv_heads * cfg.head_dim * itemsize
    return sum(per_position * (min(context, w) if w else context) for w in cfg.layer_windows)


def weight_types(params: Params) -> dict[str, dict[str, int]]:
    """{type name: {count, bytes}} over the weights (QTensor types, dense dtypes)."""
    out: dict[str, dict[str, int]] = {}
    for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QTensor)):
        name = leaf.qtype.name if isinstance(leaf, QTensor) else str(leaf.dtype)
        entry = out.setdefault(name, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += _leaf_bytes(leaf)
    return dict(sorted(out.items()))


def roofline(weight_bytes_per_step: int, kv_bytes_per_seq: float, batch: int, bandwidth_bytes_per_s: float) -> dict:
    step_bytes = weight_bytes_per_step + batch * kv_bytes_per_seq
    return dict(bytes_per_step=int(step_bytes), weight_bytes=int(weight_bytes_per_step),
                kv_bytes=int(batch * kv_bytes_per_seq),
                step_time_s=step_bytes / bandwidth_bytes_per_s,
                tokens_per_s=batch * bandwidth_bytes_per_s / step_bytes)


# ---------------------------------------------------------------------------------------------
# Nominal HBM bandwidth (bytes/s) by device kind, for the report beside the measured figure.
NOMINAL_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H200": 4.8e12,
                     "A100-SXM4-80GB": 2.039e12, "A100-SXM4-40GB": 1.555e12}


def _probes(n: int, passes: int):
    """name -> (jitted function of (array, passes), bytes it moves per pass over n float32)."""
    def repeat(body):
        # A loop whose trip count is a runtime value: XLA can neither unroll nor fuse the passes.
        return jax.jit(lambda a, k: jax.lax.fori_loop(0, k, lambda i, b: body(b), a))

    return {
        # A device-to-device copy: XLA's memcpy of the whole buffer into a fresh one.
        "copy": (jax.jit(lambda a, k: jnp.copy(a)), 1),
        # Elementwise passes that read and write every byte.
        "add_one": (repeat(lambda b: b + 1.0), passes),
        "negate": (repeat(lambda b: -b), passes),
    }


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, passes: int = 4, batches: int = 7) -> dict:
    """Device memory bandwidth: several probes over an array of nbytes (a device-to-device copy
    and elementwise passes, each reading and writing every byte), each timed as `batches` batches
    of `repeats` dispatches waited for together. A probe's rate is its fastest batch, and the
    fastest probe is the ceiling (`bytes_per_s`): a slower batch or probe only says that something
    else held it back (a median of batches once put the ceiling under what the decode attention
    kernel read in the same run: docs/kernels.md). Also the device's nominal bandwidth where it
    is known."""
    n = max(1, nbytes // 4)
    x = jnp.zeros((n,), jnp.float32)
    k = jnp.int32(passes)
    probes = {}
    for name, (f, per_dispatch) in _probes(n, passes).items():
        f(x, k).block_until_ready()
        samples = []
        for _ in range(max(1, batches)):
            # `repeats` dispatches queued back to back and waited for once: the device runs them
            # one after another while the host's dispatch and wait are paid once, not per copy
            # (one wait per copy read less than the decode attention kernel reads).
            t0 = time.perf_counter()
            jax.block_until_ready([f(x, k) for _ in range(max(1, repeats))])
            samples.append((time.perf_counter() - t0) / max(1, repeats))
        moved = 2 * 4 * n * per_dispatch
        best_s = min(samples)
        probes[name] = dict(bytes_moved=moved, samples_s=samples, best_s=best_s, bytes_per_s=moved / best_s)
    del x
    best = max(probes, key=lambda name: probes[name]["bytes_per_s"])
    kind = jax.devices()[0].device_kind
    nominal = next((v for key, v in NOMINAL_BANDWIDTH.items() if key in kind), None)
    b = probes[best]
    return dict(array_bytes=4 * n, probe=best, bytes_moved=b["bytes_moved"], samples_s=b["samples_s"],
                best_s=b["best_s"], bytes_per_s=b["bytes_per_s"], gb_per_s=b["bytes_per_s"] / 1e9,
                probes={name: dict(gb_per_s=v["bytes_per_s"] / 1e9, best_s=v["best_s"]) for name, v in probes.items()},
                nominal_gb_per_s=None if nominal is None else nominal / 1e9)


def memory_stats() -> dict | None:
    stats = jax.devices()[0].memory_stats()
    if not stats:
        return None
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "largest_alloc_size")
    return {k: int(stats[k]) for k in keys if k in stats}
