"""Benchmark the fused quantized matmul on a GPU: weight GB/s against the measured HBM copy
bandwidth, TFLOP/s against XLA's bf16 dot, and the error against the reference per row.
Full mode times, per type, shape and M, what the model runs (`qmatmul`: its kernel in the
"path" column, its time over its M=1 time in "vs_m1") beside the float kernel's default tiles
and, for M > 64, the fused GEMM and dequantize-then-dot.

    PYTHONPATH=. python3 benchmarks/quant_matmul.py [--mode full|sweep] [--out results.json]
        [--types Q4_K,Q8_0] [--shapes 4096x4096,...] [--ms 1,16,64,2048]

Timing: each measured call runs inside one jitted function that calls the op on `copies`
distinct weight copies (together at least 3x the 50 MB L2, so weights stream from HBM; small
shapes hit the cap of 16 copies and are marked L2-resident), dispatched `reps` times back to
back and timed on the host clock around the batch after a warm-up; the median of 3 batches
per call is reported. This is the time of the kernel as it runs in a jitted model step,
launch gaps included. All compiles run first, in parallel threads. With `--timing kernels`
the batch is traced instead and the time is the GPU kernels' summed durations per call (no
launch gaps, no host dispatch): the measure for small shapes, where the host-clocked batch
times the host's dispatch rather than the GPU.

Ceilings measured in the same run: HBM bandwidth, the fastest of a 2 GiB device-to-device
copy and elementwise passes (rjax.engine.roofline.measure_bandwidth; bytes read + written), bf16 TFLOP/s by jnp.dot at 8192^3 and by jnp.dot at each row's
own shape (the "xla_bf16" column: the same product on an already-dequantized bf16 weight).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from pallas_kernels.quant_matmul.gemm import gemm_config, qmatmul_gemm
from pallas_kernels.quant_matmul import qmatmul
from pallas_kernels.quant_matmul.gemv import MAX_M, decode_path, default_gemv_config, gemv_config, qmatmul_gemv, uses_int8
from pallas_kernels.quant_matmul.int8_gemv import Int8GemvConfig, int8_gemv
from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul
from pallas_kernels.quant_matmul.reference import dequantize_then_dot
from gguf_blocks import formats
from gguf_blocks.qtensor import QTensor
from rjax.engine.roofline import measure_bandwidth
from rjax.math.layout import gpu_weight_layout
from gguf_blocks.reference import dequantize

warnings.simplefilter("ignore", DeprecationWarning)

TYPES = [QType.Q4_K, QType.Q6_K, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0]
LLAMA8B = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
SMOLLM = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
LM_HEAD = (49152, 576)          # tied embedding, Q8_0 only
MS = [1, 16, 64, 2048]
L2_BYTES = 50 * 2**20
_F16_SCALE = {QType.Q8_0: 1 / 64, QType.Q4_0: 1 / 8, QType.Q4_1: 1 / 8, QType.Q5_0: 1 / 16,
              QType.Q4_K: 1 / 256, QType.Q6_K: 1 / 1024}


def log(*a):
    print(*a, flush=True)
    sys.stdout.flush()


@functools.partial(jax.jit, static_argnames=("qtype", "n", "k", "model_layout"))
def device_qtensor(qtype: QType, n: int, k: int, key, model_layout: bool = True) -> QTensor:
    """Random valid blocks generated on the device (random bytes, random-sign f16 scales), in
    the layout `rjax.load` gives a GPU model (rjax.math.layout.gpu_weight_layout: Q4_K scales per
    chunk, quant planes as int32 words) unless `model_layout` is off."""
    cls, fields = formats.LAYOUTS[qtype]
    nb = k // GGML_QUANT_SIZES[qtype][0]
    planes = []
    for i, f in enumerate(fields):
        kk = jax.random.fold_in(key, i)
        shape = (n, nb) + tuple(f.shape)
        if np.dtype(f.dtype) == np.float16:
            mag = jax.random.uniform(kk, shape, jnp.float32, 0.5, 1.0) * _F16_SCALE[qtype]
            sign = jnp.where(jax.random.bernoulli(jax.random.fold_in(kk, 1), 0.5, shape), 1.0, -1.0)
            planes.append((mag * sign).astype(jnp.float16))
        else:
            bits = jax.random.bits(kk, shape, jnp.uint8)
            planes.append(jax.lax.bitcast_convert_type(bits, f.dtype) if f.dtype != np.uint8 else bits)
    w = QTensor(cls(*planes), qtype, (n, k))
    return gpu_weight_layout(w) if model_layout else w


def wbytes(qtype, n, k):
    return formats.tensor_nbytes(qtype, (n, k))


@dataclasses.dataclass
class Job:
    row: dict                       # what is reported
    fn: object                      # fn(x, w) -> out
    make_w: object                  # key -> weight (QTensor or array)
    w_nbytes: int
    m: int
    k: int
    check: bool = True              # compare against the f32 reference
    compiled: object = None
    error: str | None = None


def _copies(nbytes):
    return int(min(12, max(2, math.ceil(3 * L2_BYTES / max(nbytes, 1)))))


def _batched(fn, n_copies):
    def many(x, ws):
        return [fn(x, w) for w in ws]
    return jax.jit(many)


def _shape_of(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def lower(job: Job):
    key = jax.random.key(0)
    w_shape = _shape_of(jax.eval_shape(job.make_w, key))
    n_copies = _copies(job.w_nbytes)
    x_shape = jax.ShapeDtypeStruct((job.m, job.k), jnp.bfloat16)
    job.row["copies"] = n_copies
    job.row["l2_resident"] = n_copies * job.w_nbytes < 2 * L2_BYTES
    return _batched(job.fn, n_copies).trace(x_shape, [w_shape] * n_copies).lower()


def time_compiled(compiled, x, ws, min_batch_s=0.02):
    out = compiled(x, ws)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(x, ws))
    one = time.perf_counter() - t0
    reps = int(min(400, max(2, math.ceil(min_batch_s / max(one, 1e-6)))))
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = compiled(x, ws)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / (reps * len(ws)))
    return statistics.median(samples), out


@jax.jit
def _ref_product(x, w):
    wd = dequantize(w) if isinstance(w, QTensor) else w.astype(jnp.float32)
    return jax.lax.dot_general(x.astype(jnp.float32), wd, (((1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)


_REF_CACHE: dict = {}


def _x_for(k, m_max):
    key = jax.random.key(k)
    return jax.random.normal(key, (m_max, k), jnp.float32).astype(jnp.bfloat16)


def _ref_for(job: Job, w0, x_full):
    """f32 reference of x_full @ w0.T, once per (type, N, K); rows for smaller M are slices."""
    key = (job.row["type"], job.row["N"], job.k)
    if key not in _REF_CACHE:
        if len(_REF_CACHE) > 8:
            _REF_CACHE.clear()
        _REF_CACHE[key] = _ref_product(x_full, w0)
    return _REF_CACHE[key]


def kernel_time(compiled, x, ws, trace_dir="/tmp/qmm-trace"):
    """GPU time per call: the summed durations of every kernel of one traced batch (the
    product's own kernels and its small XLA fusions: activation quantizing, split-K sums),
    divided by the calls in it. Launch gaps are left out: small shapes are otherwise timed
    as the host's dispatch of the batch."""
    import shutil

    from benchmarks.profile_decode import kernel_times

    shutil.rmtree(trace_dir, ignore_errors=True)
    jax.block_until_ready(compiled(x, ws))
    with jax.profiler.trace(trace_dir):
        out = compiled(x, ws)
        jax.block_until_ready(out)
    total, _ = kernel_times(trace_dir)
    own = sum(t for name, t in total.items() if any(s in name for s in ("qmatmul", "int8_gemv", "wgmma_")))
    kernel_time.own_us = own / 1e3 / len(ws)  # the Pallas kernel alone, without the fusions
    return sum(total.values()) / 1e9 / len(ws), out


def run_job(job: Job, m_max: int, timing: str = "host"):
    r = job.row
    base = jax.random.key(hash((r["type"], r["N"], job.k)) % 2**31)
    ws = [job.make_w(jax.random.fold_in(base, i)) for i in range(r["copies"])]
    x_full = _x_for(job.k, m_max)
    x = x_full[: job.m]
    if r["kind"] == "qmatmul":
        r["path"] = ("reference" if jax.default_backend() != "gpu" else
                     decode_path(x, ws[0]) if job.m <= MAX_M else "prefill")
    t, outs = (kernel_time if timing == "kernels" else time_compiled)(job.compiled, x, ws)
    r["timing"] = timing
    if timing == "kernels" and getattr(kernel_time, "own_us", 0):
        r["pallas_us"] = kernel_time.own_us
        kernel_time.own_us = 0
    r["time_us"] = t * 1e6
    r["weight_GBps"] = job.w_nbytes / t / 1e9
    r["TFLOPs"] = 2 * job.m * job.k * r["N"] / t / 1e12
    if job.check:
        ref = _ref_for(job, ws[0], x_full)[: job.m]
        out = outs[0].astype(jnp.float32)
        r["finite"] = bool(jnp.all(jnp.isfinite(out)))
        r["rel_err"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    del ws, outs


def measure_ceilings():
    # HBM: the fastest of rjax.engine.roofline's probes over 2 GiB (a device copy, elementwise passes).
    hbm = measure_bandwidth(2 << 30)["gb_per_s"]
    s = 8192
    p = jax.random.normal(jax.random.key(2), (s, s), jnp.bfloat16)
    q = jax.random.normal(jax.random.key(3), (s, s), jnp.bfloat16)
    mm = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    jax.block_until_ready(mm(p, q))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(5):
            o = mm(p, q)
        jax.block_until_ready(o)
        ts.append((time.perf_counter() - t0) / 5)
    tflops = 2 * s**3 / min(ts) / 1e12
    return hbm, tflops


def valid(qtype, k):
    return k % GGML_QUANT_SIZES[qtype][0] == 0


def bf16_job(n, k, m):
    """XLA's bf16 dot on a dense weight of the same shape: the plain baseline."""
    return Job(dict(kind="xla_bf16", type="bf16", N=n, K=k, M=m),
               lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype),
               lambda key: jax.random.normal(key, (n, k), jnp.bfloat16), 2 * n * k, m, k, check=False)


def full_jobs(types, shapes, ms):
    jobs = []
    for (n, k) in shapes:
        for m in ms:
            jobs.append(bf16_job(n, k, m))
            for qt in types:
                if not valid(qt, k) or ((n, k) == LM_HEAD and qt != QType.Q8_0):
                    continue
                mk = (lambda key, qt=qt, n=n, k=k: device_qtensor(qt, n, k, key))
                nbytes = wbytes(qt, n, k)
                # what the model runs (`qmatmul`'s dispatch; its kernel goes in the "path" column)
                jobs.append(Job(dict(kind="qmatmul", type=qt.name, N=n, K=k, M=m), qmatmul, mk, nbytes, m, k))
                if m <= 64:
                    cfg = default_gemv_config(qt, m, n, k)
                    jobs.append(Job(dict(kind="gemv", type=qt.name, N=n, K=k, M=m, config=str(cfg)),
                                    lambda x, w, cfg=cfg: fused_qmatmul(x, w, cfg), mk, nbytes, m, k))
                else:
                    cfg = gemm_config(qt, m, n, k)
                    jobs.append(Job(dict(kind="gemm_fused", type=qt.name, N=n, K=k, M=m, config=str(cfg)),
                                    lambda x, w, cfg=cfg: fused_qmatmul(x, w, cfg), mk, nbytes, m, k))
                    jobs.append(Job(dict(kind="gemm_dequant_dot", type=qt.name, N=n, K=k, M=m),
                                    dequantize_then_dot, mk, nbytes, m, k))
    return jobs


def sweep_configs(qt, m, n, k):
    bs = GGML_QUANT_SIZES[qt][0]
    out = [default_gemv_config(qt, m, n, k)] if m <= 64 else []
    if m == 1:
        for bn in (8, 16, 32):
            for vps in (128, 256):
                for warps in (2, 4, 8):
                    out.append(gemv_config(qt, m, n, k, method="fma", block_n=bn, values_per_step=vps,
                                           programs=264, num_warps=warps))
    elif m > 64:
        bk = max(1, 64 // bs)
        for bm, bn, warps in ((128, 128, 8), (128, 128, 4), (128, 256, 8), (64, 128, 4)):
            out.append(TileConfig(bm, bn, bk, num_warps=warps, num_stages=3))
    return list(dict.fromkeys(out))


def sweep_jobs(types, shapes, ms):
    jobs = []
    for (n, k) in shapes:
        for qt in types:
            if not valid(qt, k):
                continue
            mk = (lambda key, qt=qt, n=n, k=k: device_qtensor(qt, n, k, key))
            nbytes = wbytes(qt, n, k)
            for m in ms:
                for cfg in sweep_configs(qt, m, n, k):
                    jobs.append(Job(dict(kind="sweep", type=qt.name, N=n, K=k, M=m, config=str(cfg)),
                                    lambda x, w, cfg=cfg: fused_qmatmul(x, w, cfg), mk, nbytes, m, k,
                                    check=True))
                if m > 64:
                    jobs.append(Job(dict(kind="sweep_dequant_dot", type=qt.name, N=n, K=k, M=m),
                                    dequantize_then_dot, mk, nbytes, m, k))
    return jobs


INT8_TYPES = (QType.Q4_K, QType.Q8_0, QType.Q6_K, QType.Q4_1, QType.Q4_0)


INT8_GRID = dict(block_n=(16, 32, 64), values=None, warps=(4,), stages=(3,), programs=(264,), prefetch=(1,))


def int8_configs(qt, m, n, k, grid=None):
    """Candidate tiles for the int8 GEMV: rows per program, values per step, warps, pipeline
    stages, prefetch; K is split until there are about `programs` programs (264: 2 per SM)."""
    g = grid or INT8_GRID
    bs = GGML_QUANT_SIZES[qt][0]
    out = []
    for bn in g["block_n"]:
        for vps in g["values"] or ((512, 1024) if bs == 256 else (256, 512)):
            for warps in g["warps"]:
                for stages in g["stages"]:
                    for programs in g["programs"]:
                        for prefetch in g["prefetch"]:
                            bk = max(1, vps // bs)
                            n_tiles = -(-n // bn)
                            split = max(1, min(-(-programs // n_tiles), k // bs // bk))
                            out.append(Int8GemvConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps,
                                                      num_stages=stages, prefetch=bool(prefetch)))
    return list(dict.fromkeys(out))


def int8_jobs(types, shapes, ms, sweep_int8=True, packed=False):
    """The int8 GEMV's tile sweep on the byte planes (the model's layout), beside the float
    kernel's default and XLA's bf16 dot."""
    jobs = []
    for (n, k) in shapes:
        for m in ms:
            jobs.append(bf16_job(n, k, m))
        for qt in types:
            if not valid(qt, k) or qt not in INT8_TYPES:
                continue
            mk = (lambda key, qt=qt, n=n, k=k: device_qtensor(qt, n, k, key))
            nbytes = wbytes(qt, n, k)
            for m in ms:
                cfg = default_gemv_config(qt, m, n, k)
                jobs.append(Job(dict(kind="float_gemv", type=qt.name, N=n, K=k, M=m, config=str(cfg)),
                                lambda x, w, cfg=cfg: fused_qmatmul(x, w, cfg), mk, nbytes, m, k))
                jobs.append(Job(dict(kind="qmatmul", type=qt.name, N=n, K=k, M=m,
                                     config="int8" if uses_int8(qt, m, n, k, jnp.bfloat16) else "float"),
                                qmatmul, mk, nbytes, m, k))
                if not sweep_int8:
                    continue
                for c in int8_configs(qt, m, n, k, INT8_GRID):
                    jobs.append(Job(dict(kind="int8_bytes", type=qt.name, N=n, K=k, M=m, config=str(c)),
                                    lambda x, w, c=c: int8_gemv(x, w, c), mk, nbytes, m, k))
                    if packed and qt == QType.Q4_K:  # the file's packed scales (the model uses Q4_KChunks)
                        jobs.append(Job(dict(kind="int8_packed", type=qt.name, N=n, K=k, M=m, config=str(c)),
                                        lambda x, w, c=c: int8_gemv(x, w, c),
                                        lambda key, qt=qt, n=n, k=k: device_qtensor(qt, n, k, key, model_layout=False),
                                        nbytes, m, k))
    return jobs


def compile_all(jobs, workers):
    t0 = time.perf_counter()
    lowered = []
    for j in jobs:
        try:
            lowered.append(lower(j))
        except Exception as e:  # noqa: BLE001 - report and go on with the other rows
            j.error = f"lower: {type(e).__name__}: {str(e)[:300]}"
            lowered.append(None)
    log(f"lowered {len(jobs)} jobs in {time.perf_counter() - t0:.1f}s")

    def comp(pair):
        j, low = pair
        if low is None:
            return
        try:
            j.compiled = low.compile()
        except Exception as e:  # noqa: BLE001
            j.error = f"compile: {type(e).__name__}: {str(e)[:300]}"

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(comp, zip(jobs, lowered)))
    log(f"compiled in {time.perf_counter() - t0:.1f}s; failures: {sum(j.error is not None for j in jobs)}")


def fmt_row(r, hbm):
    if r.get("error"):
        return f"{r['kind']:17s} {r['type']:5s} {r['N']:6d}x{r['K']:<6d} M={r['M']:<5d} ERROR {r['error'][:120]}"
    pct = 100 * r["weight_GBps"] / hbm
    s = (f"{r['kind']:17s} {r['type']:5s} {r['N']:6d}x{r['K']:<6d} M={r['M']:<5d} {r['time_us']:9.1f}us "
         f"{r['weight_GBps']:7.0f}GB/s {pct:5.1f}%HBM {r['TFLOPs']:7.1f}TF")
    if r.get("pallas_us"):
        s += f" (pallas {r['pallas_us']:.1f}us)"
    if "rel_err" in r:
        s += f" err={r['rel_err']:.1e}"
    if r.get("l2_resident"):
        s += " L2"
    if "vs_bf16" in r:
        s += f" {r['vs_bf16']:.2f}x_bf16"
    if "vs_m1" in r:
        s += f" {r['vs_m1']:.2f}x_M1"
    if "path" in r:
        s += f" [{r['path']}]"
    if "config" in r and r["kind"] in ("sweep", "gemv", "gemm_fused", "float_gemv", "int8_words", "int8_bytes", "int8_packed",
                                       "qmatmul"):
        s += " " + r["config"].replace("TileConfig", "").replace("Int8GemvConfig", "")
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("full", "sweep", "int8", "decode"), default="full")
    ap.add_argument("--types", default=",".join(t.name for t in TYPES))
    ap.add_argument("--shapes", default="")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--timing", choices=("host", "kernels"), default="host",
                    help="host: wall clock around batches of calls; kernels: summed GPU kernel time from a trace")
    ap.add_argument("--out", default="quant_matmul.json")
    ap.add_argument("--packed", action="store_true", help="int8 sweep: also Q4_K with the file's packed scales")
    ap.add_argument("--time-budget", type=float, default=1e9, help="stop timing rows after this many seconds")
    for name in INT8_GRID:
        ap.add_argument(f"--int8-{name.replace('_', '-')}", default=None,
                        help=f"int8 sweep: comma-separated {name} values")
    a = ap.parse_args()
    for name in INT8_GRID:
        given = getattr(a, f"int8_{name}")
        if given:
            INT8_GRID[name] = tuple(int(v) for v in given.split(","))
    t_start = time.perf_counter()
    types = [QType[t] for t in a.types.split(",") if t]
    shapes = ([tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")] if a.shapes
              else LLAMA8B + SMOLLM + [LM_HEAD])
    ms = [int(v) for v in a.ms.split(",")]
    dev = jax.devices()[0]
    log(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    hbm, peak = measure_ceilings()
    log(f"HBM copy bandwidth: {hbm:.0f} GB/s (read+write); bf16 jnp.dot 8192^3: {peak:.0f} TFLOP/s")
    jobs = {"full": full_jobs, "sweep": sweep_jobs, "int8": lambda *args: int8_jobs(*args, packed=a.packed),
            "decode": lambda *args: int8_jobs(*args, sweep_int8=False)}[a.mode](types, shapes, ms)
    compile_all(jobs, a.workers)
    rows = []
    for i, j in enumerate(jobs):
        if time.perf_counter() - t_start > a.time_budget:
            log(f"time budget reached; {len(jobs) - i} rows not timed")
            break
        if j.error is None:
            try:
                run_job(j, m_max=max(ms), timing=a.timing)
            except Exception as e:  # noqa: BLE001
                j.error = f"run: {type(e).__name__}: {str(e)[:300]}"
        j.row["error"] = j.error
        j.compiled = None
        rows.append(j.row)
        if a.mode != "full":
            log(fmt_row(j.row, hbm))
    # Derived columns: per-shape bf16 baseline; for what the model runs, the time over its M=1 time.
    base = {(r["N"], r["K"], r["M"]): r for r in rows if r["kind"] == "xla_bf16" and not r.get("error")}
    one_row = {(r["type"], r["N"], r["K"]): r for r in rows if r["kind"] == "qmatmul" and r["M"] == 1
               and not r.get("error")}
    for r in rows:
        b = base.get((r["N"], r["K"], r["M"]))
        if b and not r.get("error") and r["kind"] != "xla_bf16":
            r["vs_bf16"] = b["time_us"] / r["time_us"]
        o = one_row.get((r["type"], r["N"], r["K"]))
        if o and r["kind"] == "qmatmul" and 1 < r["M"] <= MAX_M and not r.get("error"):
            r["vs_m1"] = r["time_us"] / o["time_us"]
    if a.mode == "full":
        for r in rows:
            log(fmt_row(r, hbm))
    else:
        log("best per (type, shape, M):")
        groups: dict = {}
        for r in rows:
            if not r.get("error"):
                groups.setdefault((r["type"], r["N"], r["K"], r["M"]), []).append(r)
        for g in groups.values():
            for r in sorted(g, key=lambda r: r["time_us"])[:3]:
                log("  " + fmt_row(r, hbm))
    result = dict(device=dev.device_kind, jax=jax.__version__, hbm_copy_GBps=hbm, bf16_peak_TFLOPs=peak,
                  mode=a.mode, rows=rows, seconds=time.perf_counter() - t_start)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {a.out} ({len(rows)} rows) in {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
