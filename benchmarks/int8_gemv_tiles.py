"""Tiles of the int8 decode GEMV at one row, as the model runs it: Q4_K weights in the GPU layout
(rjax.model.gpu_weight_layout), x rounded by the kernel before (quantize_rows), the split-K
partial sums left for the consumer. GPU kernel time per product for rows per program, values
per step, programs (K split until about that many) and warps, beside the default tiles.

    PYTHONPATH=. python3 benchmarks/int8_gemv_tiles.py --out "$OUT/gemv-tiles.json"

Each jitted call runs the product over enough distinct weights (about 160 MB in all) that they
stream from HBM, not L2; `us` is the int8 GEMV kernels' summed durations per product, and
`us_all` adds the rest of the call's kernels per product (the rounding of x, shared by all).

With --glu, the gate/up shapes as the FFN runs them: the product that applies the GLU and rounds
its output (int8_gemv_glu) over its tiles, against the default product followed by the GLU's
rounding pass (quantize_silu_glu), both counted in `us`.

    PYTHONPATH=. python3 benchmarks/int8_gemv_tiles.py --glu --type Q4_K --shapes 8b-gateup,1b-gateup
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
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profile_decode import compile_concurrently, traced_kernel_times  # noqa: E402
from benchmarks.quant_matmul import device_qtensor, wbytes  # noqa: E402
from pallas_kernels.int8_activations import quantize_rows  # noqa: E402
from pallas_kernels.quant_matmul.gemv import default_glu_config, default_int8_config  # noqa: E402
from pallas_kernels.quant_matmul.int8_gemv import Int8GemvConfig, int8_gemv, int8_gemv_glu  # noqa: E402

warnings.simplefilter("ignore", DeprecationWarning)
# N x K of the llama-8b and llama-1b products (QKV, O, gate/up, down).
SHAPES = {"8b-qkv": (6144, 4096), "8b-o": (4096, 4096), "8b-gateup": (28672, 4096), "8b-down": (4096, 14336),
          "1b-qkv": (3072, 2048), "1b-o": (2048, 2048), "1b-gateup": (16384, 2048), "1b-down": (2048, 8192),
          "8b-out": (128256, 4096), "1b-out": (128256, 2048)}
GRID = dict(block_n=(4, 8, 16), values=(512, 1024), programs=(264, 528, 1056), num_warps=(4, 8))
# The output layers (Q6_K in a Q4_K_M file): one wave is far below their row tiles, so no split.
GRIDS = {QType.Q6_K: dict(block_n=(16, 32, 64), values=(512, 1024, 2048), programs=(1,), num_warps=(4, 8))}
GLU_GRID = dict(block_n=(32, 64), values=(256, 512, 1024), num_warps=(4, 8))
STREAM_BYTES = 160e6


def configs(qt: QType, n: int, k: int) -> list:
    out = [None]  # the default
    block = GGML_QUANT_SIZES[qt][0]
    for bn, values, programs, warps in itertools.product(*GRIDS.get(qt, GRID).values()):
        bk = max(1, values // block)
        split = max(1, min(-(-programs // -(-n // bn)), k // block // bk))
        out.append(Int8GemvConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps))
    return list(dict.fromkeys(out))


def glu_configs(qt: QType, n: int, k: int) -> list:
    out = [None, default_glu_config(qt, 1, n, k)]  # the two-kernel path, the default GLU tiles
    block = GGML_QUANT_SIZES[qt][0]
    for bn, values, warps in itertools.product(*GLU_GRID.values()):
        if (n // 2) % bn == 0 and values >= block:
            out.append(Int8GemvConfig(block_n=bn, block_k=values // block, num_warps=warps))
    return list(dict.fromkeys(out))


def streamed_operands(qt: QType, n: int, k: int, min_copies: int = 2):
    """Distinct weights of one shape, enough (about STREAM_BYTES) that a call over all of them
    streams from HBM rather than L2, and one bf16 activation row."""
    copies = max(min_copies, round(STREAM_BYTES / wbytes(qt, n, k)))
    ws = [device_qtensor(qt, n, k, jax.random.key(i)) for i in range(copies)]
    return ws, jax.random.normal(jax.random.key(99), (1, k), jnp.float32).astype(jnp.bfloat16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gemv-tiles.json")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--type", default="Q4_K", help="GGML type of the weights")
    ap.add_argument("--glu", action="store_true", help="the gate/up product with the GLU applied (see above)")
    a = ap.parse_args()
    qt = QType[a.type]
    t0 = time.perf_counter()
    jobs = []
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        ws, x = streamed_operands(qt, n, k)
        copies = len(ws)
        for cfg in (glu_configs if a.glu else configs)(qt, n, k):
            if a.glu and cfg is None:  # the two-kernel path it replaces
                c = default_int8_config(qt, 1, n, k)
                fn = jax.jit(lambda x, ws, c=c: [quantize_rows(int8_gemv(quantize_rows(x), w, c), "silu") for w in ws])
                label = f"product + GLU pass, {c}"
            elif a.glu:
                fn = jax.jit(lambda x, ws, c=cfg: [int8_gemv_glu(quantize_rows(x), w, c, "silu") for w in ws])
                label = f"GLU in the product, {cfg}"
            else:
                c = cfg or default_int8_config(qt, 1, n, k)
                fn = jax.jit(lambda x, ws, c=c: [int8_gemv(quantize_rows(x), w, c, partials=True) for w in ws])
                label = str(c)
            jobs.append(dict(shape=name, n=n, k=k, copies=copies, config=label, default=cfg is None,
                             fn=fn, args=(x, ws)))

    compiled = compile_concurrently([(job["fn"], job["args"]) for job in jobs], a.workers)
    print(f"compiled {len(jobs)} programs in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for job, exe in zip(jobs, compiled):
        row = {key: job[key] for key in ("shape", "n", "k", "config", "default")}
        if isinstance(exe, str):
            row["error"] = exe
        else:
            try:
                total, _ = traced_kernel_times(exe, job["args"])
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                continue
            row["us"] = sum(t for nm, t in total.items() if "int8_gemv" in nm or "glu" in nm) / 1e3 / job["copies"]
            row["us_all"] = sum(total.values()) / 1e3 / job["copies"]
            row["tb_s"] = wbytes(qt, job["n"], job["k"]) / row["us"] / 1e6
        rows.append(row)
    print("best per shape (us per product, weight TB/s):")
    for name in a.shapes.split(","):
        ok = sorted((r for r in rows if r["shape"] == name and "us" in r), key=lambda r: r["us"])
        default = next((r for r in ok if r["default"]), None)
        for r in ok[:4]:
            print(f"  {name:10s} {r['us']:6.2f} ({r['tb_s']:.2f}) {r['config']}")
        if default:
            print(f"  {name:10s} {default['us']:6.2f} ({default['tb_s']:.2f}) default {default['config']}")
    Path(a.out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, type=qt.name, glu=a.glu, rows=rows),
                                      indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
