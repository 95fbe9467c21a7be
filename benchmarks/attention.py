"""Attention on the GPU: rjax's Pallas kernels against the peers, all measured in the same run.

Peers: jax.nn.dot_product_attention with implementation "cudnn" and "xla"; JAX's shipped Pallas GPU
ops (attention.mha and the Mosaic GPU attention_mgpu.attention for prefill, decode_attention.gqa
and paged_attention.paged_attention for decode); and the HBM bandwidth (the fastest of
rjax.engine.roofline's probes: a large device-to-device copy, elementwise passes).
Each implementation gets its inputs in its own native layout (the layout change is not timed).

Timing: jitted call, two warm-ups, then the median over repetitions of the mean over a batch of
back-to-back asynchronous calls (host dispatch overlaps device work). Inputs smaller than 4x the
H100's 50 MB L2 are rotated among several copies, all issued by one jitted call, so no
measurement reads the cache and dispatch overhead is shared by the copies.

Prefill reports TFLOP/s counting the causal half (4 * B * Hq * D * S^2 / 2); decode reports GB/s
of K and V read (2 * B * Hkv * S * D * bytes).

"append" rows time the decode step's rotate-and-append (pallas_kernels.kv_append: the kernel
against its XLA reference, jitted with the cache donated) at smollm2's, llama-1b's and
llama-8b's heads, per KV dtype, contiguous and paged: a launch of a few kilobytes, so the time
is the GPU kernel time per call from a profiler trace of a chain of calls over distinct
per-layer caches in one program, with the kernels per call beside it.

    PYTHONPATH=. python3 benchmarks/attention.py --json out.json [--quick] [--sweep] [--only append]
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rjax.engine.roofline import measure_bandwidth
from pallas_kernels.attention import (
    decode_attention, mgpu_prefill_attention, paged_decode_attention, prefill_attention,
)
from pallas_kernels.kv_append import rope_append

ROTATE_BYTES = 200e6
DTYPE = jnp.bfloat16


def measure(fn, make_set, set_bytes, *, target_s=0.1, reps=5, max_sets=32):
    """Median seconds per call of fn(*make_set(i)) (see module docstring)."""
    n_sets = int(min(max_sets, max(1, math.ceil(ROTATE_BYTES / max(set_bytes, 1)))))
    sets = [make_set(i) for i in range(n_sets)]
    multi = jax.jit(lambda sets: [fn(*s) for s in sets])
    jax.block_until_ready(multi(sets))
    t0 = time.perf_counter()
    jax.block_until_ready(multi(sets))
    once = time.perf_counter() - t0
    iters = int(max(1, min(200, target_s / max(once, 1e-6))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = multi(sets)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / (iters * n_sets))
    del sets, out
    return statistics.median(samples), {"n_sets": n_sets, "iters": iters, "spread": max(samples) / min(samples)}


def normal(seed, shape, dtype=DTYPE):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


# ---------------------------------------------------------------- peers


def _jax_sdpa(impl, causal):
    def f(q, k, v):  # q [B, T, Hq, D], k, v [B, S, Hkv, D]
        return jax.nn.dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, is_causal=causal,
                                            implementation=impl)
    return f


def _pallas_mha(q, k, v):  # k, v repeated to Hq heads: mha has no grouped-query support
    from jax.experimental.pallas.ops.gpu import attention as ops
    return ops.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True)


def _pallas_mgpu(block_kv):
    from jax.experimental.pallas.ops.gpu import attention_mgpu as ops
    cfg = ops.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=True)
    return lambda q, k, v: ops.attention(q, k, v, cfg)  # no scale argument: q is pre-scaled


def _pallas_gqa(q, k, v, kv_len):  # q [B, Hq, D], k, v [B, S, Hkv, D]
    from jax.experimental.pallas.ops.gpu import decode_attention as ops
    return ops.gqa(q, k, v, kv_seq_len=kv_len, sm_scale=q.shape[-1] ** -0.5)


def _pallas_paged(q, k_pages, v_pages, table, kv_len):  # k_pages [Hkv, P, page_size, D]
    from jax.experimental.pallas.ops.gpu import paged_attention as ops
    # Its default of 8 pages per block overflows shared memory at page_size 64: use 128-key blocks.
    per_block = max(1, 128 // k_pages.shape[2])
    splits = max(1, min(16, table.shape[1] // per_block))
    return ops.paged_attention(q * q.shape[-1] ** -0.5, k_pages, v_pages, table, kv_len,
                               pages_per_compute_block=per_block, k_splits=splits)


# ---------------------------------------------------------------- cases


def run_one(rows, kind, shape, impl, fn, make_set, set_bytes, work, unit, note=""):
    row = dict(kind=kind, shape=shape, impl=impl, note=note)
    try:
        sec, info = measure(fn, make_set, set_bytes)
        row.update(us=sec * 1e6, rate=work / sec / 1e12 if unit == "TFLOP/s" else work / sec / 1e9,
                   unit=unit, **info)
    except Exception as e:  # a peer that cannot run this shape is reported, not fatal
        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        traceback.print_exc(limit=2, file=sys.stderr)
    rows.append(row)
    rate = f"{row['rate']:8.1f} {unit}" if "rate" in row else row["error"][:90]
    us = f"{row['us']:9.1f} us" if "us" in row else " " * 12
    print(f"{kind:8s} {shape:30s} {impl:28s} {us} {rate}", flush=True)
    return row


def device_copy(rows):
    """The ceiling: the fastest of rjax.engine.roofline's probes (a device-to-device copy, elementwise
    passes) over 2 GiB, bytes read + written."""
    bw = measure_bandwidth(2 << 30)
    row = dict(kind="copy", shape="2 GiB", impl=f"fastest probe: {bw['probe']}", us=bw["best_s"] * 1e6,
               rate=bw["gb_per_s"], unit="GB/s", note=", ".join(f"{k} {v['gb_per_s']:.0f}" for k, v in bw["probes"].items()))
    rows.append(row)
    print(f"{'copy':8s} {row['shape']:30s} {row['impl']:28s} {row['us']:9.1f} us {row['rate']:8.1f} GB/s ({row['note']})",
          flush=True)


def prefill_case(rows, S, D, *, Hq=32, Hkv=8, B=1, peers=True, sweep=(), mosaic_sweep=()):
    shape = f"B={B} S={S} H={Hq}/{Hkv} D={D}"
    flops = 4 * B * Hq * D * S * S / 2
    scale = D ** -0.5
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    kv_len = jnp.full((B,), S, jnp.int32)
    q_bytes = B * S * Hq * D * 2
    kv_bytes = 2 * B * S * Hkv * D * 2

    def ours(i):
        return normal(3 * i, (B, S, Hq, D)), normal(3 * i + 1, (B, Hkv, S, D)), normal(3 * i + 2, (B, Hkv, S, D))

    configs = [dict()] + [dict(c) for c in sweep]
    for cfg in configs:
        name = "rjax pallas" + ("" if not cfg else " " + ",".join(f"{k}={v}" for k, v in cfg.items()))
        fn = lambda q, k, v, cfg=cfg: prefill_attention(q, k, v, pos, kv_len, scale=scale, **cfg)
        run_one(rows, "prefill", shape, name, fn, ours, q_bytes + kv_bytes, flops, "TFLOP/s")
    for cfg in [dict()] + [dict(c) for c in mosaic_sweep]:
        name = "rjax mosaic" + ("" if not cfg else " " + ",".join(f"{k}={v}" for k, v in cfg.items()))
        fn = lambda q, k, v, cfg=cfg: mgpu_prefill_attention(q, k, v, pos, kv_len, scale=scale, **cfg)
        run_one(rows, "prefill", shape, name, fn, ours, q_bytes + kv_bytes, flops, "TFLOP/s")
    if not peers:
        return

    def native(i):
        return normal(3 * i, (B, S, Hq, D)), normal(3 * i + 1, (B, S, Hkv, D)), normal(3 * i + 2, (B, S, Hkv, D))

    run_one(rows, "prefill", shape, "jax cudnn", _jax_sdpa("cudnn", True), native, q_bytes + kv_bytes, flops,
            "TFLOP/s")
    run_one(rows, "prefill", shape, "jax xla", _jax_sdpa("xla", True), native, q_bytes + kv_bytes, flops,
            "TFLOP/s")

    def repeated(i):
        q, k, v = native(i)
        return q, jnp.repeat(k, Hq // Hkv, axis=2), jnp.repeat(v, Hq // Hkv, axis=2)

    run_one(rows, "prefill", shape, "jax pallas mha (triton)", _pallas_mha, repeated, 3 * q_bytes, flops,
            "TFLOP/s", note="K/V repeated to Hq heads")
    for block_kv in (128, 64):
        def scaled_f16(i):  # attention_mgpu declares its shared-memory tiles float16
            q, k, v = native(i)
            return (q * scale).astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16)
        row = run_one(rows, "prefill", shape, f"jax pallas mgpu bkv={block_kv}", _pallas_mgpu(block_kv),
                      scaled_f16, q_bytes + kv_bytes, flops, "TFLOP/s", note="float16")
        if "us" in row:
            break


def decode_case(rows, B, S, *, Hq=32, Hkv=8, D=128, peers=True, paged=True, page_size=64, sweep=(),
                paged_sweep=()):
    shape = f"B={B} ctx={S} H={Hq}/{Hkv} D={D}"
    kv_bytes = 2 * B * Hkv * S * D * 2
    scale = D ** -0.5
    pos = jnp.full((B, 1), S - 1, jnp.int32)
    kv_len = jnp.full((B,), S, jnp.int32)

    def ours(i):
        return normal(3 * i, (B, 1, Hq, D)), normal(3 * i + 1, (B, Hkv, S, D)), normal(3 * i + 2, (B, Hkv, S, D))

    configs = [dict()] + [dict(c) for c in sweep]
    for cfg in configs:
        name = "rjax pallas" + ("" if not cfg else " " + ",".join(f"{k}={v}" for k, v in cfg.items()))
        fn = lambda q, k, v, cfg=cfg: decode_attention(q, k, v, pos, kv_len, scale=scale, **cfg)
        run_one(rows, "decode", shape, name, fn, ours, kv_bytes, kv_bytes, "GB/s")

    n_pages = S // page_size
    table = jnp.arange(B * n_pages, dtype=jnp.int32).reshape(B, n_pages)
    table = jax.random.permutation(jax.random.key(9), table.reshape(-1)).reshape(B, n_pages)
    if paged:
        def ours_paged(i):
            q, k, v = ours(i)
            to_pool = lambda x: (x.reshape(B, Hkv, n_pages, page_size, D).transpose(0, 2, 1, 3, 4)
                                 .reshape(B * n_pages, Hkv, page_size, D)[jnp.argsort(table.reshape(-1))])
            return q, to_pool(k), to_pool(v)

        for cfg in [dict()] + [dict(c) for c in paged_sweep]:
            name = f"rjax pallas paged ps={page_size}" + "".join(f",{k}={v}" for k, v in cfg.items())
            fn = lambda q, kp, vp, cfg=cfg: paged_decode_attention(q, kp, vp, table, pos, kv_len, scale=scale, **cfg)
            run_one(rows, "decode", shape, name, fn, ours_paged, kv_bytes, kv_bytes, "GB/s")
    if not peers:
        return

    def native(i):
        return normal(3 * i, (B, 1, Hq, D)), normal(3 * i + 1, (B, S, Hkv, D)), normal(3 * i + 2, (B, S, Hkv, D))

    run_one(rows, "decode", shape, "jax cudnn", _jax_sdpa("cudnn", False), native, kv_bytes, kv_bytes, "GB/s")
    run_one(rows, "decode", shape, "jax xla", _jax_sdpa("xla", False), native, kv_bytes, kv_bytes, "GB/s")
    run_one(rows, "decode", shape, "jax pallas gqa (triton)", lambda q, k, v: _pallas_gqa(q[:, 0], k, v, kv_len),
            native, kv_bytes, kv_bytes, "GB/s")
    if paged:
        def shipped_paged(i):
            q, k, v = native(i)
            to_pool = lambda x: (x.reshape(B, n_pages, page_size, Hkv, D).transpose(3, 0, 1, 2, 4)
                                 .reshape(Hkv, B * n_pages, page_size, D)[:, jnp.argsort(table.reshape(-1))])
            return q[:, 0], to_pool(k), to_pool(v)

        run_one(rows, "decode", shape, f"jax pallas paged ps={page_size}",
                lambda q, kp, vp: _pallas_paged(q, kp, vp, table, kv_len), shipped_paged, kv_bytes, kv_bytes, "GB/s")


PREFILL_SWEEP = {
    128: [dict(block_q=128, block_k=128, num_warps=8, num_stages=3), dict(block_q=64, block_k=64, num_warps=4),
          dict(block_q=64, block_k=64, num_warps=4, num_stages=4), dict(block_q=128, block_k=64, num_warps=8,
                                                                         num_stages=4)],
    256: [dict(block_q=64, block_k=32, num_warps=4, num_stages=3), dict(block_q=128, block_k=64, num_warps=8),
          dict(block_q=64, block_k=64, num_warps=8, num_stages=2), dict(block_q=32, block_k=64, num_warps=4)],
}
MOSAIC_SWEEP = {128: [dict(ping_pong=False)], 256: [dict(ping_pong=False)]}
PAGED_SWEEP = [dict(block_k=64), dict(block_k=64, num_stages=4)]
DECODE_SWEEP = [dict(block_k=128, num_stages=2)]


APPEND_HEADS = {"smollm2": (9, 3, 64), "llama-1b": (32, 8, 64), "llama-8b": (32, 8, 128)}
APPEND_LAYERS = 16  # distinct caches in the chain


def append_case(rows, heads: str, B: int, kv: str, *, paged: bool, ctx=1024, page_size=16, n_parts=2):
    """The rotate-and-append kernel and its XLA reference: kernel time per call (see the module
    docstring), each token at a random position of its own row (paged: of a random page)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from profile_decode import traced_kernel_times

    hq, hkv, d = APPEND_HEADS[heads]
    shape = f"{heads} B={B} {kv}{' paged' if paged else ''}"
    cshape = (B * ctx // page_size, hkv, page_size, d) if paged else (B, hkv, ctx, d)
    cdt = {"bf16": DTYPE, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kv]
    keys = iter(jax.random.split(jax.random.key(B), 4 * APPEND_LAYERS + 2))

    def layer():
        k, v = (jax.random.normal(next(keys), cshape, DTYPE).astype(cdt) for _ in range(2))
        if kv == "int8":
            return k, v, jnp.full(cshape[:3], 0.02, jnp.float32), jnp.full(cshape[:3], 0.03, jnp.float32)
        if kv == "fp8":
            return k, v, jnp.ones((hkv,), jnp.float32), jnp.full((hkv,), 2.0, jnp.float32)
        return k, v, None, None

    layers = [layer() for _ in range(APPEND_LAYERS)]
    parts = [jax.random.normal(next(keys), (n_parts, B, 1, (hq + 2 * hkv) * d), jnp.float32)
             for _ in range(APPEND_LAYERS)]
    pos = jax.random.randint(next(keys), (B, 1), 0, ctx, jnp.int32)
    inv = 1.0 / 10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    if paged:
        pages = jax.random.permutation(next(keys), B * ctx // page_size).reshape(B, -1).astype(jnp.int32)
        rows_, at = pages[jnp.arange(B)[:, None], pos // page_size], pos % page_size
    else:
        rows_, at = jnp.arange(B, dtype=jnp.int32), None
    for impl in ("pallas", "reference"):
        def chain(layers, parts):
            out = []
            for (k, v, ks, vs), p in zip(layers, parts):
                q, k, v, ks, vs = rope_append(p, None, pos, k, v, inv, rows_, n_heads=hq, pairing="pairs",
                                              dtype=DTYPE, implementation=impl, k_scale=ks, v_scale=vs, at=at)
                out.append(((k, v, ks, vs), q))
            return [o[0] for o in out], [o[1] for o in out]

        exe = jax.jit(chain, donate_argnums=0)
        row = dict(kind="append", shape=shape, impl="kernel" if impl == "pallas" else "xla", note="")
        try:
            state = {"layers": exe(layers, parts)[0]}

            def once(p):
                state["layers"], qs = exe(state["layers"], p)
                return qs

            total, count = traced_kernel_times(once, (parts,))
            layers = state["layers"]
            kernels = sum(count.values()) / APPEND_LAYERS
            row.update(us=sum(total.values()) / APPEND_LAYERS / 1e3, rate=kernels, unit="kernels")
        except Exception as e:
            row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            traceback.print_exc(limit=2, file=sys.stderr)
        rows.append(row)
        us = f"{row['us']:9.2f} us {kernels:.0f} kernels" if "us" in row else row["error"][:90]
        print(f"{'append':8s} {shape:30s} {row['impl']:28s} {us}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="attention_bench.json")
    ap.add_argument("--quick", action="store_true", help="one prefill and one decode shape")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configurations")
    ap.add_argument("--prefill-sweep", action="store_true", help="also time the Triton prefill tile sweep")
    ap.add_argument("--only", choices=("prefill", "decode", "append"), default=None)
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}, jax {jax.__version__}", flush=True)
    rows = []
    device_copy(rows)
    if args.quick:
        prefill_shapes, decode_shapes = [(2048, 128)], [(8, 8192)]
    else:
        prefill_shapes = [(2048, 128), (8192, 128), (2048, 256), (8192, 256)]
        decode_shapes = [(b, s) for b in (1, 8, 64) for s in (1024, 8192, 32768)]

    def save():  # after every case, so a run cut short still leaves its numbers
        copy_bw = next((r["rate"] for r in rows if r["kind"] == "copy" and "rate" in r), None)
        with open(args.json, "w") as f:
            json.dump(dict(device=dev.device_kind, jax=jax.__version__, copy_GBps=copy_bw, rows=rows), f, indent=1)
        return copy_bw

    if args.only in (None, "prefill"):
        for S, D in prefill_shapes:
            prefill_case(rows, S, D, sweep=PREFILL_SWEEP[D] if args.prefill_sweep and S == 2048 else (),
                         mosaic_sweep=MOSAIC_SWEEP[D] if args.sweep and S == 2048 else ())
            save()
    if args.only in (None, "decode"):
        for B, S in decode_shapes:
            sweep = DECODE_SWEEP if args.sweep and (B, S) == (8, 8192) else ()
            decode_case(rows, B, S, sweep=sweep, paged_sweep=PAGED_SWEEP if sweep else ())
            save()
    if args.only in (None, "append"):
        for kv in ("bf16", "int8", "fp8"):
            for paged in (False, True):
                for heads in APPEND_HEADS:
                    for B in ((8,) if args.quick else (1, 8, 32)):
                        append_case(rows, heads, B, kv, paged=paged)
                        save()
    copy_bw = save()
    print_summary(rows, copy_bw)


def print_summary(rows, copy_bw):
    print("\nsummary (rate; decode also as % of copy bandwidth; prefill also as x cuDNN)")
    by_shape = {}
    for r in rows:
        by_shape.setdefault((r["kind"], r["shape"]), []).append(r)
    for (kind, shape), rs in by_shape.items():
        if kind == "copy":
            continue
        cudnn = next((r.get("us") for r in rs if r["impl"] == "jax cudnn"), None)
        for r in rs:
            if "us" not in r:
                print(f"{kind:8s} {shape:30s} {r['impl']:40s} {'n/a':>10s}  {r['error'][:60]}")
                continue
            extra = ""
            if kind == "decode" and copy_bw:
                extra = f"{100 * r['rate'] / copy_bw:5.1f}% of copy"
            if kind == "prefill" and cudnn:
                extra = f"{cudnn / r['us']:5.2f}x cuDNN"
            kernel = next((k.get("us") for k in rs if k["impl"] == "kernel"), None)
            if kind == "append" and kernel:
                extra = f"{r['us'] / kernel:5.2f}x the kernel"
            print(f"{kind:8s} {shape:30s} {r['impl']:40s} {r['us']:10.1f} us {r['rate']:8.1f} {r['unit']:8s} {extra}")


if __name__ == "__main__":
    main()
