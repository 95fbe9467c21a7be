"""What a decode product gains when part of its weight is already in L2 (H100: 50 MB).

For each llama-8b / llama-1b Q4_K product at one row (x rounded before, as in the model), GPU
kernel time per product: streamed from HBM ("cold"), and after a kernel of its own (`warm`)
read the first fraction of every weight row ("warm"). Each call runs the product over enough
distinct weights (about 160 MB) that nothing is left in L2 from the previous one; each warm
kernel is ordered right before its product, and each product before the next warm kernel.

The question it answers: would the small latency-bound kernels of a decode step (norms,
attention) pay for reading the next product's weight into L2 with programs that otherwise
idle? Session 11's answer (results/h100-2026-11-22-s11/run2-l2-warm.json): little. A weight
wholly in L2 made 4096x4096 1.5 us faster (5.95 -> 4.45), 4096x14336 4.1 us (15.7 -> 11.6),
and half of 28672x4096 2.8 us (27.0 -> 24.2): the kernel is not bound by HBM alone.

`warm` reads what it is given and stores the int32 sum of it per program: Triton drops
loads whose values go unused, and XLA drops a kernel whose output nobody uses, so the sums
are returned with the products.

    PYTHONPATH=. python3 benchmarks/l2_warm.py --out "$OUT/l2-warm.json"
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import functools
import math

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as QType
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.int8_gemv_tiles import SHAPES, streamed_operands  # noqa: E402
from benchmarks.profile_decode import compile_concurrently, traced_kernel_times  # noqa: E402
from benchmarks.quant_matmul import wbytes  # noqa: E402
from pallas_kernels.int8_activations import quantize_rows  # noqa: E402
from pallas_kernels.quant_matmul.gemv import default_int8_config  # noqa: E402
from pallas_kernels.quant_matmul.int8_gemv import int8_gemv  # noqa: E402

warnings.simplefilter("ignore", DeprecationWarning)
FRACTIONS = (0.25, 0.5, 1.0)


_I32 = jnp.int32
TILE_ELEMENTS = 4096


def _as_int(v):
    if v.dtype == jnp.float16 or v.dtype == jnp.bfloat16:
        v = jax.lax.bitcast_convert_type(v, jnp.int16)
    elif v.dtype == jnp.float32:
        v = jax.lax.bitcast_convert_type(v, _I32)
    return v.astype(_I32)


def leading_columns(cols: int, fraction: float) -> int:
    return min(cols, max(1, math.ceil(cols * fraction)))


def _touch(refs, program, n_programs: int, fraction: float):
    """Read the first `fraction` of the columns of every row of each 2-D ref, rows spread over
    n_programs programs (this is `program`); the int32 sum of what was read."""
    total = jnp.zeros((), _I32)
    for ref in refs:
        n, c_all = ref.shape
        c = leading_columns(c_all, fraction)
        ct = min(pl.next_power_of_2(c), TILE_ELEMENTS)
        rt = max(1, TILE_ELEMENTS // ct)
        per = pl.cdiv(n, n_programs)
        n_rt, n_ct = pl.cdiv(per, rt), pl.cdiv(c, ct)
        r_end = jnp.minimum((program + 1) * per, n)

        def body(i, acc, ref=ref, c=c, ct=ct, rt=rt, per=per, n_ct=n_ct, r_end=r_end):
            tile_row, tile_col = (i, 0) if n_ct == 1 else (i // jnp.int32(n_ct), i % jnp.int32(n_ct))
            r0 = program * per + tile_row * rt
            c0 = tile_col * ct
            rows = r0 + jax.lax.broadcasted_iota(_I32, (rt, ct), 0)
            cols = c0 + jax.lax.broadcasted_iota(_I32, (rt, ct), 1)
            v = plgpu.load(ref.at[pl.ds(r0, rt), pl.ds(c0, ct)], mask=(rows < r_end) & (cols < c), other=0)
            return acc + _as_int(v)

        acc = jax.lax.fori_loop(0, n_rt * n_ct, body, jnp.zeros((rt, ct), _I32))
        total = total + jnp.sum(acc)
    return total


def _warm_kernel(*refs, n_programs: int, fraction: float):
    *ins, out_ref = refs
    p = pl.program_id(0)
    out_ref[p] = _touch(ins, p, n_programs, fraction)


def rows_view(a: jax.Array) -> jax.Array:
    """A (rows, everything else) view of an array whose leading axis is the weight rows."""
    return a.reshape(a.shape[0], -1)


@functools.partial(jax.jit, static_argnames=("fraction", "programs", "num_warps", "interpret"))
def warm(arrays, fraction: float = 1.0, programs: int = 264, num_warps: int = 4, interpret: bool = False):
    """A kernel of its own that reads the first `fraction` of every row of `arrays` (weight
    planes, rows first) into L2; returns the per-program sums (int32 [programs])."""
    views = [rows_view(a) for a in jax.tree.leaves(arrays)]
    kernel = functools.partial(_warm_kernel, n_programs=programs, fraction=fraction)
    return pl.pallas_call(kernel, grid=(programs,), out_shape=jax.ShapeDtypeStruct((programs,), _I32),
                          compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
                          interpret=interpret, name="l2_warm")(*views)


def warm_reference(arrays, fraction: float = 1.0, programs: int = 264):
    """What `warm` returns, in plain JAX."""
    out = jnp.zeros((programs,), _I32)
    for a in jax.tree.leaves(arrays):
        v = rows_view(a)
        n, c_all = v.shape
        v = v[:, :leading_columns(c_all, fraction)]
        if v.dtype in (jnp.float16, jnp.bfloat16):
            v = jax.lax.bitcast_convert_type(v, jnp.int16)
        elif v.dtype == jnp.float32:
            v = jax.lax.bitcast_convert_type(v, _I32)
        row_sums = jnp.sum(v.astype(_I32), axis=1)
        per = -(-n // programs)
        owner = jnp.arange(n) // per
        out = out + jax.ops.segment_sum(row_sums, owner, num_segments=programs)
    return out


def chained(x, ws, cfg, fraction, programs):
    """Products over ws one after another, each after its warm kernel when fraction > 0."""
    xq = quantize_rows(x)
    outs, prev = [], None  # the warm kernels' sums are returned too: XLA drops unused kernels
    for w in ws:
        if prev is not None:  # this weight's warm kernel (or product) waits for the last product
            w, _ = jax.lax.optimization_barrier((w, prev))
        if fraction:
            sink = warm(w.planes, fraction, programs)
            w, sink = jax.lax.optimization_barrier((w, sink))
            outs.append(sink)
        prev = int8_gemv(xq, w, cfg, partials=True)
        outs.append(prev)
    return outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="l2-warm.json")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--programs", default="132,264")
    a = ap.parse_args()
    qt = QType.Q4_K
    t0 = time.perf_counter()
    jobs = []
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        nbytes = wbytes(qt, n, k)
        ws, x = streamed_operands(qt, n, k, min_copies=3)
        copies = len(ws)
        cfg = default_int8_config(qt, 1, n, k)
        for fraction in (0.0,) + FRACTIONS:
            if fraction * nbytes > 45e6:
                continue
            for programs in ([0] if not fraction else [int(p) for p in a.programs.split(",")]):
                fn = jax.jit(lambda x, ws, cfg=cfg, f=fraction, p=programs: chained(x, ws, cfg, f, p))
                jobs.append(dict(shape=name, n=n, k=k, mb=nbytes / 1e6, copies=copies, fraction=fraction,
                                 programs=programs, fn=fn, args=(x, ws)))
    compiled = compile_concurrently([(j["fn"], j["args"]) for j in jobs])
    print(f"compiled {len(jobs)} programs in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for job, exe in zip(jobs, compiled):
        row = {key: job[key] for key in ("shape", "n", "k", "mb", "fraction", "programs")}
        if isinstance(exe, str):
            row["error"] = exe
        else:
            total, _ = traced_kernel_times(exe, job["args"])
            row["gemv_us"] = sum(t for nm, t in total.items() if "int8_gemv" in nm) / 1e3 / job["copies"]
            row["warm_us"] = sum(t for nm, t in total.items() if "l2_warm" in nm) / 1e3 / job["copies"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
