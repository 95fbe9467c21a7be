"""Tiles of the one-token decode attention at batch 1 (the kernel with kv_append's pass as its
prologue, as the model runs it): GPU kernel time per call, the split combine included, for
block sizes, split counts, warps and pipeline stages, beside the default tiles.

    PYTHONPATH=. python3 benchmarks/decode_attention_tiles.py --out "$OUT/attn-tiles.json"

Each measured call attends one token at position 576 of a 1,024-key cache (as `rjax bench`
with prompt 512 decodes), over LAYERS distinct caches per jitted call so the keys stream from
HBM, not L2; the time is the traced kernels' summed durations divided by LAYERS.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profile_decode import compile_concurrently, traced_kernel_times  # noqa: E402
from pallas_kernels.attention import decode_rope_attention  # noqa: E402

warnings.simplefilter("ignore", DeprecationWarning)
SHAPES = {"llama-8b": (32, 8, 128), "llama-1b": (32, 8, 64), "smollm2-135m": (9, 3, 64)}
CACHE, POS, LAYERS, PARTS = 1024, 576, 16, 2
GRID = dict(block_k=(64, 128), num_splits=(4, 8, 16), num_warps=(4,), num_stages=(1, 3))


def inputs(hq, hkv, d, seed=0):
    r = np.random.default_rng(seed)
    n = (hq + 2 * hkv) * d
    parts = jnp.asarray(r.standard_normal((PARTS, 1, n)) / PARTS, jnp.float32)
    caches = [(jnp.asarray(r.standard_normal((1, hkv, CACHE, d)), jnp.bfloat16),
               jnp.asarray(r.standard_normal((1, hkv, CACHE, d)), jnp.bfloat16)) for _ in range(LAYERS)]
    inv = 1.0 / 10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    return parts, jnp.asarray([POS], jnp.int32), caches, inv


def program(hq, d, tiles):
    def run(parts, pos, caches, inv):
        outs, arrivals = [], jnp.zeros((1, caches[0][0].shape[1]), jnp.int32)  # carried as the KV cache does
        for k, v in caches:
            out, _, _, arrivals = decode_rope_attention(parts, None, pos, k, v, inv, n_heads=hq, pairing="pairs",
                                                        dtype=jnp.bfloat16, scale=d ** -0.5, arrivals=arrivals,
                                                        **tiles)
            outs.append(out)
        return outs
    return jax.jit(run)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="attn-tiles.json")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--workers", type=int, default=14)
    a = ap.parse_args()
    t0 = time.perf_counter()
    jobs = []
    for name in a.shapes.split(","):
        hq, hkv, d = SHAPES[name]
        args = inputs(hq, hkv, d)
        configs = [{}] + [dict(zip(GRID, vals)) for vals in itertools.product(*GRID.values())]
        jobs += [(name, tiles, args, program(hq, d, tiles)) for tiles in configs]

    compiled = compile_concurrently([(fn, args) for _, _, args, fn in jobs], a.workers)
    print(f"compiled {len(jobs)} programs in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for (name, tiles, args, _), exe in zip(jobs, compiled):
        row = dict(shape=name, tiles=tiles or "default")
        if isinstance(exe, str):
            row["error"] = exe
        else:
            try:
                total, count = traced_kernel_times(exe, args)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(row, flush=True)
                continue
            walls = []
            for _ in range(30):
                t = time.perf_counter()
                jax.block_until_ready(exe(*args))
                walls.append(time.perf_counter() - t)
            row["wall_us"] = float(np.median(walls)) * 1e6 / LAYERS
            row["us"] = sum(total.values()) / 1e3 / LAYERS
            row["kernel_us"] = sum(t for n, t in total.items() if "attention" in n) / 1e3 / LAYERS
            row["kernels"] = sum(count.values()) / LAYERS
        rows.append(row)
        print(row, flush=True)
    print("best per shape:")
    for name in a.shapes.split(","):
        ok = sorted((r for r in rows if r["shape"] == name and "us" in r), key=lambda r: r["us"])
        default = next((r for r in ok if r["tiles"] == "default"), None)
        for r in ok[:5]:
            print(f"  {name:14s} {r['us']:6.2f} us ({r['kernel_us']:.2f} in the kernel, {r['kernels']:.1f} kernels, "
                  f"{r['wall_us']:.2f} wall) "
                  f"{r['tiles']}")
        if default:
            print(f"  {name:14s} {default['us']:6.2f} us default ({default['wall_us']:.2f} wall)")
    Path(a.out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, cache=CACHE, pos=POS,
                                           rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
