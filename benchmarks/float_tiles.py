"""Tiles of the float decode kernel (kernel.py, tensor-core "mma" path) at M = 8..32 rows, with
its two dequantizations: "f32" (every quant to float32, scaled, rounded to bf16) and "bf16x2"
(packed bf16 instructions, tiles.py), and the Mosaic GPU wgmma kernel ("wgmma",
wgmma_skinny.py; its split-K partial sums, as the int8 GEMV's, are left for the consumer). Q4_K
(or `--type`) in the GPU layout; GPU kernel time per product, beside the M=1 int8 GEMV (its
default tiles, x rounded before; for a type it lacks, the "f32" row at M=1, the float kernel's
CUDA-core tiles) that issue 6's M=16 target compares with, and the HBM copy bandwidth measured
in the same run.

    PYTHONPATH=. python3 benchmarks/float_tiles.py --out "$OUT/float-tiles.json"

Each jitted call runs the product over enough distinct weights (about 160 MB) that they stream
from HBM; `rel_err` is the first weight's product against x @ dequantize(w).T in float32.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as QType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.int8_gemv_tiles import SHAPES as _SHAPES  # noqa: E402
from benchmarks.int8_gemv_tiles import streamed_operands  # noqa: E402
from benchmarks.profile_decode import compile_concurrently, traced_kernel_times  # noqa: E402
from benchmarks.quant_matmul import measure_ceilings, wbytes  # noqa: E402
from pallas_kernels.int8_activations import quantize_rows  # noqa: E402
from pallas_kernels.quant_matmul.gemv import (INT8_TILES, bf16x2_config, default_gemv_config,  # noqa: E402
                                              default_int8_config, gemv_config)
from pallas_kernels.quant_matmul.int8_gemv import int8_gemv  # noqa: E402
from pallas_kernels.quant_matmul.kernel import fused_qmatmul  # noqa: E402
from pallas_kernels.quant_matmul import wgmma_skinny  # noqa: E402
from rjax.quant.reference import dequantize  # noqa: E402

warnings.simplefilter("ignore", DeprecationWarning)
SHAPES = {**_SHAPES, "8b-up": (14336, 4096), "8b-kv": (1024, 4096)}   # issue 6: 14336x4096, 4096x14336 (8b-down), 4096x1024
GRIDS = {"small": dict(block_n=(64, 128), values=(256, 512), programs=(264, 528), num_warps=(4, 8), num_stages=(3,)),
         "large": dict(block_n=(32, 64, 128), values=(256, 512, 1024), programs=(264, 528, 1056), num_warps=(4, 8),
                       num_stages=(2, 3, 4)),
         "none": dict(block_n=(), values=(), programs=(), num_warps=(), num_stages=()),
         "wide": dict(block_n=(64, 128, 256), values=(256, 512), programs=(264, 528), num_warps=(4, 8),
                      num_stages=(2, 3))}


def configs(w, qt, m, n, k, dequant, grid):
    """The default tiles for "f32" (swept in earlier sessions), a grid of tiles otherwise."""
    if dequant == "f32":
        return [default_gemv_config(qt, m, n, k)]
    if dequant == "wgmma":
        out = [wgmma_skinny.default_config(n, k)]
        if grid != "none":
            out += [wgmma_skinny.WgmmaConfig(b, st) for b in (2, 4, 8, 16) for st in (2, 3) if (k // 256) % b == 0]
        return list(dict.fromkeys(out))
    out = [bf16x2_config(w, m, jnp.bfloat16)] if dequant == "bf16x2" else []   # the production tiles
    for bn, values, programs, warps, stages in itertools.product(*GRIDS[grid].values()):
        c = gemv_config(qt, m, n, k, block_n=bn, values_per_step=values, programs=programs, num_warps=warps,
                        num_stages=stages)
        out.append(dataclasses.replace(c, dequant=dequant))
    return list(dict.fromkeys(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="float-tiles.json")
    ap.add_argument("--shapes", default="8b-up,8b-down,1b-gateup")
    ap.add_argument("--ms", default="8,16,32")
    ap.add_argument("--dequants", default="f32,bf16x2")
    ap.add_argument("--grid", default="small", help=f"tiles to sweep: {', '.join(GRIDS)}; name=grid,... per M")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--type", default="Q4_K", help="GGML type of the weights (Q4_K, Q8_0, ...)")
    a = ap.parse_args()
    grids = dict(kv.split("=") for kv in a.grid.split(",")) if "=" in a.grid else {}
    qt = QType[a.type.upper()]
    hbm, peak = measure_ceilings()
    print(f"HBM copy {hbm:.0f} GB/s, bf16 dot {peak:.0f} TFLOP/s", flush=True)
    t0 = time.perf_counter()
    jobs = []
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        ws, x1 = streamed_operands(qt, n, k)
        if qt in INT8_TILES:   # else (Q5_0) the M=1 baseline is the float kernel's row: run with --ms 1
            c = default_int8_config(qt, 1, n, k)
            jobs.append(dict(shape=name, m=1, dequant="int8", config=str(c), copies=len(ws), args=(x1, ws), w0=ws[0],
                             fn=jax.jit(lambda x, ws, c=c: [int8_gemv(quantize_rows(x), w, c, partials=True)
                                                             for w in ws])))
        for m in map(int, a.ms.split(",")):
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
            for dq in a.dequants.split(","):
                grid = grids.get(str(m), "small") if grids else a.grid
                for cfg in configs(ws[0], qt, m, n, k, dq, grid):
                    fn = ((lambda x, ws, c=cfg: [wgmma_skinny.wgmma_matmul(x, w, c, partials=True) for w in ws])
                          if dq == "wgmma" else (lambda x, ws, c=cfg: [fused_qmatmul(x, w, c) for w in ws]))
                    jobs.append(dict(shape=name, m=m, dequant=dq, config=str(cfg), copies=len(ws), args=(x, ws),
                                     w0=ws[0], fn=jax.jit(fn)))
    compiled = compile_concurrently([(job["fn"], job["args"]) for job in jobs], a.workers)
    print(f"compiled {len(jobs)} programs in {time.perf_counter() - t0:.0f} s", flush=True)
    rows, refs = [], {}
    for job, exe in zip(jobs, compiled):
        row = {key: job[key] for key in ("shape", "m", "dequant", "config")}
        n, k = SHAPES[job["shape"]]
        if isinstance(exe, str):
            row["error"] = exe
            rows.append(row)
            continue
        try:
            total, _ = traced_kernel_times(exe, job["args"])
            x, ws = job["args"]
            out = exe(x, ws)[0]
            if job["dequant"] in ("int8", "wgmma"):
                out = out.sum(axis=0)
            key = (job["shape"], job["m"], job["dequant"] == "int8")   # the M=1 int8 job has its own x
            if key not in refs:
                refs[key] = x.astype(jnp.float32) @ dequantize(job["w0"]).astype(jnp.float32).T
            ref = refs[key]
            row["rel_err"] = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            continue
        keep = ("qmatmul", "int8_gemv", "wgmma_")
        row["us"] = sum(t for nm, t in total.items() if any(s in nm for s in keep)) / 1e3 / job["copies"]
        row["us_all"] = sum(total.values()) / 1e3 / job["copies"]
        row["hbm_frac"] = wbytes(qt, n, k) / row["us"] / 1e3 / hbm
        rows.append(row)
    print("best per shape and M (us per product, fraction of the copy bandwidth, rel. error):")
    for name in a.shapes.split(","):
        base = next((r for r in rows if r["shape"] == name and "us" in r
                     and (r["dequant"] == "int8" or (qt not in INT8_TILES and r["m"] == 1 and r["dequant"] == "f32"))),
                    None)
        for m in [1] + list(map(int, a.ms.split(","))):
            for dq in ["int8"] + a.dequants.split(","):
                ok = sorted((r for r in rows if r["shape"] == name and r["m"] == m and r["dequant"] == dq
                             and "us" in r), key=lambda r: r["us"])
                for r in ok[:2]:
                    ratio = f" {r['us'] / base['us']:.2f}x M=1" if base else ""
                    print(f"  {name:10s} M={m:<3d} {dq:7s} {r['us']:7.2f} us ({r['hbm_frac']:.0%}){ratio}"
                          f" err {r['rel_err']:.1e}  {r['config']}")
    errors = [r for r in rows if "error" in r]
    for r in errors[:5]:
        print("error:", r["config"], r["error"])
    Path(a.out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, hbm_copy_GBps=hbm,
                                           bf16_peak_TFLOPs=peak, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
