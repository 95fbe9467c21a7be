"""Decode throughput with a bf16, int8 and fp8 KV cache at long contexts, against the copy roofline.

    python benchmarks/kv_dtype.py --out "$OUT/kv_dtype.json" [--workdir /tmp/rjax-kv] [--budget 420]
        [--models llama,gemma] [--no-attention] [--kv-dtypes bf16,int8,fp8] [--page-size 16]

What it measures, in one run on one GPU:
- `bandwidth`: the device's copy bandwidth (rjax.engine.roofline.measure_bandwidth: the best of a
  device-to-device copy and elementwise passes), the ceiling every fraction below is held to.
- `attention`: the decode attention kernel alone (llama-8b's heads: 32 query, 8 KV, head dim
  128; one query token; 8k, 32k and 128k keys; batch 1 and 16) per KV dtype: the kernel's time
  per call from a profiler trace of a chain of calls over distinct per-layer caches (as a
  model's layers read them: from memory, not L2), the K/V bytes it must read (values and
  scales) over that time, and that rate as a fraction of the copy bandwidth; also the chain's
  wall time per call, and the read floor: the same chain with each call only reading those
  bytes, by the faster of an XLA reduction and a TMA stream (`read_floor`): what a launch that
  reads them costs at that size.
- `decode`: engine.greedy_decode_loop tokens/s (32 steps per dispatch, the median of 3 timed
  dispatches after a warm one) of synthetic llama-8b Q4_K (`rjax synth`) at batch 1 and 16 with
  contexts 8k, 32k and 128k, and of gemma3-1b's shape (Q4_K) at 32k, per KV dtype. The cache is
  allocated at the context length and every slot holds context - 128 positions when the timed
  dispatches start: what a step reads does not depend on the values, so the cache is not
  prefilled (a 128k prefill per configuration would take the whole budget). A configuration the
  memory planner (rjax.engine.memory.plan_memory) says does not fit is reported as such, with its bytes.
- `largest_batch_32k`: per KV dtype, the most llama-8b sequences of 32k positions the planner
  fits beside the weights (contiguous cache), and that batch's decode tokens/s.
Each decode entry also has its step's bytes (weights + KV) over the step time as a fraction of
the copy bandwidth.
- `--page-size N`: the kernel and decode rows read a paged cache of N-position pages (the
  serving engine's) instead of the contiguous one: each sequence's pages are a random
  permutation of the pool, as a long-running server leaves them, not consecutive.

Every program is compiled up front, concurrently (rjax.engine.precompile), then timed. The JSON at
--out is rewritten after every measurement, so a run cut short keeps what it measured; the last
thing printed is the table. --budget (seconds, after the programs are compiled) skips what is
left when it runs out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

# The planner's free memory is the allocator's limit less what is in use: let the allocator take
# most of the GPU (JAX's default pool is 75% of it), so "the largest batch that fits" means the
# device's memory, not the default pool's.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pallas_kernels.attention import decode_attention, paged_decode_attention  # noqa: E402
from rjax.engine import steps  # noqa: E402
from rjax.engine.memory import MemoryFitError, plan_memory  # noqa: E402
from rjax.engine.precompile import compile_programs, decode_program  # noqa: E402
from rjax.engine.roofline import decode_weight_bytes, kv_bytes_per_sequence, measure_bandwidth  # noqa: E402
from rjax.math.cache import KV_DTYPES, init_cache  # noqa: E402
from rjax.math.paged_cache import init_paged_cache, set_block_tables  # noqa: E402
from rjax.math.sampling import SamplingParams  # noqa: E402

STEPS = 32          # decode steps per dispatch
REPEATS = 3         # timed dispatches per configuration
ATTENTION_KEYS = (8192, 32768, 131072)
HEADROOM = (REPEATS + 1) * STEPS + 8  # positions left free at the end of the cache: every dispatch's steps
LLAMA = dict(shape="llama-8b", quant="q4_k", runs=[(8192, 1), (8192, 16), (32768, 1), (32768, 16), (131072, 1),
                                                    (131072, 16)])
GEMMA = dict(shape="gemma3-1b", quant="q4_k", runs=[(32768, 1), (32768, 16)])


def say(msg: str) -> None:
    print(f"[kv_dtype {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def kv_value_bytes(kv: str, head_dim: int, dtype) -> float:
    """Bytes a step reads per cached K or V value (int8 carries a float32 scale per row)."""
    return {"int8": 1 + 4 / head_dim, "fp8": 1.0}.get(kv, jnp.dtype(dtype).itemsize)


# ---- the attention kernel alone -------------------------------------------------------------------

def _layer_cache(kv: str, shape, key, Hkv: int):
    """(k, v, k scale, v scale) of one layer's cache of random contents in format `kv`."""
    k1, k2 = jax.random.split(key)
    if kv == "bf16":
        return jax.random.normal(k1, shape, jnp.bfloat16), jax.random.normal(k2, shape, jnp.bfloat16), None, None
    if kv == "int8":
        scales = jnp.full(shape[:3], 0.02, jnp.float32)
        return (jax.random.randint(k1, shape, -127, 128, jnp.int8), jax.random.randint(k2, shape, -127, 128, jnp.int8),
                scales, scales)
    fp8 = lambda k: jax.random.normal(k, shape, jnp.float32).astype(jnp.float8_e4m3fn)  # noqa: E731
    return fp8(k1), fp8(k2), jnp.ones((Hkv,), jnp.float32), jnp.ones((Hkv,), jnp.float32)


def scattered_tables(B: int, pages_per_seq: int, seed: int = 7):
    """[B, pages_per_seq] block tables over a pool of B * pages_per_seq pages in random order."""
    return jax.random.permutation(jax.random.key(seed), B * pages_per_seq).reshape(B, pages_per_seq).astype(jnp.int32)


def attention_kernel(kv: str, B: int, S: int, bw: float, Hq=32, Hkv=8, D=128, calls=48,
                     page_size: int | None = None) -> dict:
    """The kernel's time per call, as a model's layers see it: a chain of calls over `layers`
    distinct caches (together past the 50 MB L2, so no call finds its K/V cached), unrolled in
    one program as the model's layers are. The kernel's own time comes from a profiler trace;
    the wall time per call (kernel, the chain's add, launch gaps) is reported beside it.
    page_size: a paged cache (`scattered_tables`), else a contiguous one."""
    from profile_decode import traced_kernel_times

    nbytes = 2 * B * Hkv * S * D * kv_value_bytes(kv, D, jnp.bfloat16)
    n_layers = int(min(8, max(2, np.ceil(160e6 / nbytes))))
    keys = jax.random.split(jax.random.key(B + S), n_layers + 1)
    shape = (B, Hkv, S, D) if page_size is None else (B * S // page_size, Hkv, page_size, D)
    layers = [_layer_cache(kv, shape, keys[i + 1], Hkv) for i in range(n_layers)]
    q = jax.random.normal(keys[0], (B, 1, Hq, D), jnp.bfloat16)
    pos = jnp.full((B, 1), S - 1, jnp.int32)
    kv_len = jnp.full((B,), S, jnp.int32)
    tables = None if page_size is None else scattered_tables(B, S // page_size)

    def attend(q, k, v, ks, vs):
        if tables is None:
            return decode_attention(q, k, v, pos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
        return paged_decode_attention(q, k, v, tables, pos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)

    @jax.jit
    def chain(q, layers):
        # Each call's output feeds the next one's query: the calls run back to back, none elided.
        for i in range(calls):
            k, v, ks, vs = layers[i % n_layers]
            out = attend(q, k, v, ks, vs)
            q = (q + out * 1e-3).astype(q.dtype)
        return q

    chain(q, layers).block_until_ready()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        chain(q, layers).block_until_ready()
        times.append((time.perf_counter() - t0) / calls)
    wall = float(np.median(times))
    total, count = traced_kernel_times(chain, (q, layers))
    kernel_ns = sum(d for name, d in total.items() if "decode_attention" in name)
    n_kernel = sum(c for name, c in count.items() if "decode_attention" in name)
    if n_kernel != calls:
        raise RuntimeError(f"the trace holds {n_kernel} decode attention kernels, expected {calls}")
    t = kernel_ns / n_kernel * 1e-9
    floors = read_floor(layers, calls)
    floor = min(f for f in floors.values() if f is not None)
    return dict(kv_dtype=kv, batch=B, keys=S, page_size=page_size, heads=[Hq, Hkv, D], layers=n_layers,
                us_per_call=t * 1e6,
                wall_us_per_call=wall * 1e6, kv_bytes=int(nbytes), gb_per_s=nbytes / t / 1e9,
                copy_fraction=nbytes / t / bw, read_floor_us=floor * 1e6, read_floor_copy_fraction=nbytes / floor / bw,
                read_floor_probes_us={name: None if f is None else f * 1e6 for name, f in floors.items()})


def read_floor(layers, calls: int) -> dict:
    """Seconds per call of the same chain reading the same K/V values with no attention, by two
    probes; the faster is the floor: what a launch that only reads the bytes costs at this size,
    against the copy rate's ideal. An int8 cache's per-entry scales (4 bytes a row of head-dim
    values, 3% at head dim 128) are left out of both.
    - "xla": one XLA row reduction per call over K + V, each call's input made to depend on the
      last call's output so none is merged or elided. (Multiplying each row by its int8 scale
      before the sum made XLA's reduction twice as slow as the attention kernel, and a second
      reduction would add a launch.)
    - "tma": `tma_stream`, None where it does not run (a GPU without Mosaic GPU's TMA). It reads
      an int8 cache at batch 1 faster than XLA's reduction or any Triton launch shape measured
      (8k keys: 7.2-7.3 us against 7.8-8.4 and 9.3; docs/kernels.md)."""
    from profile_decode import traced_kernel_times

    n_layers = len(layers)

    @jax.jit
    def reduce_chain(layers):
        acc = None
        for i in range(calls):
            k, v = layers[i % n_layers][:2]
            x = k.astype(jnp.float32) + v.astype(jnp.float32)
            if acc is not None:
                x = x + acc[..., None] * 0.0
            acc = jnp.sum(x, axis=-1)
        return acc

    @jax.jit
    def stream_chain(layers):
        out = None
        for i in range(calls):
            k, v = layers[i % n_layers][:2]
            out = tma_stream(k, v, out)  # the last call's output as an operand: no two calls merge
        return out

    floors = {}
    for name, chain in (("xla", reduce_chain), ("tma", stream_chain)):
        try:
            total, _ = traced_kernel_times(chain, (layers,))
        except Exception as e:  # noqa: BLE001
            if name == "xla":
                raise
            say(f"read floor: the TMA stream did not run ({type(e).__name__}: {str(e)[:200]})")
            floors[name] = None
            continue
        floors[name] = sum(total.values()) * 1e-9 / calls
    return floors


def tma_stream(k, v, dep=None, *, programs: int = 128, block_rows: int = 128, stages: int = 2,
               interpret: bool = False):
    """Read k and v (the same shape [..., D]) into shared memory and nothing more: `programs`
    Mosaic GPU programs each stream their run of [D] rows through a ring of `stages` slots of
    `block_rows` rows, filled by the tensor memory accelerator (TMA), one slot refilled as soon
    as its block has landed. -> [programs, 8, D]: each program's last K block in slot 0, its
    first 8 rows. dep: an earlier call's output, taken as an operand only so that a chain of
    calls keeps its order and XLA does not merge two calls over the same arrays.

    128 programs of 128-row blocks in 2 stages read llama-8b's K + V at batch 1 and 8k keys
    fastest of the shapes measured (H100: int8 84% of the copy rate, bf16 93%)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    D = k.shape[-1]
    if k.dtype.itemsize == 1 and k.dtype != jnp.int8:  # fp8: the same bytes
        k, v = (jax.lax.bitcast_convert_type(x, jnp.int8) for x in (k, v))
    k, v = k.reshape(-1, D), v.reshape(-1, D)
    rows = k.shape[0] // programs
    if k.shape[0] % programs or rows % block_rows:
        raise ValueError(f"tma_stream: {k.shape[0]} rows do not split into {programs} programs of "
                         f"{block_rows}-row blocks")
    blocks = rows // block_rows

    def body(k_ref, v_ref, dep_ref, o_ref, k_smem, v_smem, k_landed, v_landed):
        del dep_ref
        p = jax.lax.axis_index("p")

        def fetch(block, slot):
            run = pl.ds(p * rows + block * block_rows, block_rows)
            plgpu.copy_gmem_to_smem(k_ref.at[run], k_smem.at[slot], k_landed.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[run], v_smem.at[slot], v_landed.at[slot])

        for i in range(min(stages, blocks)):
            fetch(i, i)

        @pl.loop(0, blocks)
        def _(block):
            slot = jax.lax.rem(block, stages)
            plgpu.barrier_wait(k_landed.at[slot])
            plgpu.barrier_wait(v_landed.at[slot])
            pl.when(block + stages < blocks)(lambda: fetch(block + stages, slot))

        plgpu.copy_smem_to_gmem(k_smem.at[0, pl.ds(0, 8)], o_ref.at[p])
        plgpu.wait_smem_to_gmem(0)

    out_type = jax.ShapeDtypeStruct((programs, 8, D), k.dtype)
    return plgpu.kernel(
        body, out_type=out_type, grid=(programs,), grid_names=("p",),
        scratch_types=[plgpu.SMEM((stages, block_rows, D), k.dtype), plgpu.SMEM((stages, block_rows, D), k.dtype),
                       plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)],
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(k, v, jnp.zeros(out_type.shape, out_type.dtype) if dep is None else dep)


# ---- decode through the engine --------------------------------------------------------------------

def fits(cfg, kv: str, B: int, ctx: int, page_size: int | None = None) -> tuple[bool, str]:
    try:
        plan_memory(cfg, max_len=ctx, page_size=page_size, n_slots=B, prefill_tokens=16, prefill_prompts=1,
                    n_pages=None if page_size is None else B * ctx // page_size, dtype=_planner_dtype(kv))
        return True, ""
    except MemoryFitError as e:
        return False, str(e)


def _planner_dtype(kv: str):
    return "bfloat16" if kv == "bf16" else kv


def largest_batch(cfg, kv: str, ctx: int) -> int:
    try:
        return plan_memory(cfg, max_len=ctx, page_size=None, n_slots=None, prefill_tokens=16, prefill_prompts=1,
                           dtype=_planner_dtype(kv), max_slots=1024).n_slots
    except MemoryFitError:
        return 0


def decode_run(cfg, params, kv: str, B: int, ctx: int, bw: float, page_size: int | None = None) -> dict:
    if page_size is None:
        cache = init_cache(cfg, B, ctx, jnp.bfloat16, kv)
    else:
        n_pages = ctx // page_size
        cache = init_paged_cache(cfg, B, B * n_pages, page_size, ctx, jnp.bfloat16, kv)
        cache = set_block_tables(cache, jnp.arange(B), scattered_tables(B, n_pages))
    start = ctx - HEADROOM
    cache = dataclasses.replace(cache, lengths=jnp.full((B,), start, jnp.int32))
    sp = SamplingParams.make(B)
    stop = jnp.asarray([-1], jnp.int32)
    first = jnp.zeros((B,), jnp.int32)
    state = steps.initial_state(first, jnp.full((B,), HEADROOM, jnp.int32), stop, jax.random.key(0), cache)
    t0 = time.perf_counter()
    out, state, cache = steps.greedy_decode_loop(cfg, params, cache, state, sp, stop, STEPS)  # warm (compiled ahead)
    np.asarray(out)
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        out, state, cache = steps.greedy_decode_loop(cfg, params, cache, state, sp, stop, STEPS)
        out = np.asarray(out)
        times.append(time.perf_counter() - t0)
        if (out < 0).any():
            raise RuntimeError(f"decode {kv} B={B} ctx={ctx}: a slot stopped early")
    del cache, state
    t = float(np.median(times)) / STEPS
    value = kv_value_bytes(kv, cfg.head_dim, jnp.bfloat16)
    kv_step = B * kv_bytes_per_sequence(cfg, start + STEPS, value)
    step_bytes = decode_weight_bytes(cfg, params, B) + kv_step
    return dict(kv_dtype=kv, batch=B, context=ctx, page_size=page_size, tokens_per_s=B / t, ms_per_step=t * 1e3,
                kv_bytes_per_step=int(kv_step), step_bytes=int(step_bytes),
                copy_fraction=step_bytes / t / bw,
                warm_dispatch_s=warm_s)


def bench_model(spec: dict, kvs, workdir: Path, bw: float, result: dict, write, deadline: float,
                largest: bool, contexts=None, page_size: int | None = None, batches=None) -> None:
    """page_size: decode over a paged cache; its programs compile at their first dispatch
    (`rjax.engine.precompile` builds contiguous caches), and the largest batch is not looked for."""
    import rjax
    from rjax.loading.synth import write_synthetic

    name = spec["shape"]
    path = workdir / f"{name}-{spec['quant']}.gguf"
    t0 = time.perf_counter()
    if not path.exists():
        write_synthetic(path, name, spec["quant"], seed=0)
    model = rjax.load(path, progress=False)
    cfg, params = model.config, model.params
    say(f"{name} {spec['quant']}: synthesized and loaded in {time.perf_counter() - t0:.0f} s")
    entry = result.setdefault("models", {}).setdefault(name, {"quant": spec["quant"], "decode": [], "skipped": []})
    runs = []
    for ctx, B in [r for r in spec["runs"] if (contexts is None or r[0] in contexts)
                   and (batches is None or r[1] in batches)]:
        for kv in kvs:
            ok, why = fits(cfg, kv, B, ctx, page_size)
            if ok:
                runs.append((kv, B, ctx))
            else:
                entry["skipped"].append(dict(kv_dtype=kv, batch=B, context=ctx, reason=why))
    if largest and page_size is None:
        entry["largest_batch_32k"] = {kv: largest_batch(cfg, kv, 32768) for kv in kvs}
        say(f"{name}: largest batch at 32k (planner, contiguous cache): {entry['largest_batch_32k']}")
        runs += [(kv, n, 32768) for kv, n in entry["largest_batch_32k"].items()
                 if n and (kv, n, 32768) not in runs]
    t0 = time.perf_counter()
    programs = [dataclasses.replace(decode_program(cfg, params, B, ctx, jnp.bfloat16, STEPS, 1, kv_dtype=kv, greedy=True),
                                    name=f"decode {kv} B={B} ctx={ctx}") for kv, B, ctx in runs if page_size is None]
    report = compile_programs(programs, on_error="record")
    entry["compile_s"] = time.perf_counter() - t0
    say(f"{name}: compiled {len(runs)} decode programs in {entry['compile_s']:.0f} s"
        + (f"; failed: {list(report.errors)}" if report.errors else ""))
    write()
    for kv, B, ctx in runs:
        if time.perf_counter() > deadline:
            entry["skipped"].append(dict(kv_dtype=kv, batch=B, context=ctx, reason="time budget"))
            continue
        try:
            r = decode_run(cfg, params, kv, B, ctx, bw, page_size)
        except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the others
            r = dict(kv_dtype=kv, batch=B, context=ctx, error=f"{type(e).__name__}: {str(e)[:500]}")
            say(f"{name} {kv} B={B} ctx={ctx}: FAILED {r['error']}")
        else:
            say(f"{name} {kv} B={B} ctx={ctx}: {r['tokens_per_s']:,.1f} tokens/s, {r['ms_per_step']:.2f} ms/step, "
                f"{100 * r['copy_fraction']:.0f}% of copy")
        entry["decode"].append(r)
        write()
    del model, params


def table(result: dict) -> str:
    lines = []
    bw = result.get("bandwidth", {})
    lines.append(f"copy bandwidth {bw.get('gb_per_s', 0):.0f} GB/s ({bw.get('probe')}; nominal "
                 f"{bw.get('nominal_gb_per_s') or 0:.0f}; probes "
                 + ", ".join(f"{k} {v['gb_per_s']:.0f}" for k, v in bw.get("probes", {}).items())
                 + f") on {result['device']}")
    if result.get("page_size"):
        lines.append(f"paged cache: {result['page_size']}-position pages in random order")
    if result.get("attention"):
        lines.append("\ndecode attention kernel, llama-8b heads: kernel us per call (profiler), GB/s of K/V, % of copy; "
                     "chain wall us per call; the read floor (the faster of an XLA reduction and a TMA stream that only "
                     "read the same bytes) us, % of copy")
        for a in result["attention"]:
            if "error" in a:
                lines.append(f"  {a['kv_dtype']:5} B={a['batch']:<3} {a.get('keys', '?'):>6} keys: {a['error'][:60]}")
                continue
            lines.append(f"  {a['kv_dtype']:5} B={a['batch']:<3} {a['keys']:>6} keys {a['us_per_call']:9.1f} us "
                         f"{a['gb_per_s']:8.0f} GB/s {100 * a['copy_fraction']:5.1f}%  wall {a['wall_us_per_call']:8.1f} us"
                         + (f"  floor {a['read_floor_us']:8.1f} us {100 * a['read_floor_copy_fraction']:5.1f}%"
                            if "read_floor_us" in a else "")
                         + "".join(f" {name} {us:.1f}" for name, us in a.get("read_floor_probes_us", {}).items()
                                   if us is not None))
    for name, m in result.get("models", {}).items():
        lines.append(f"\n{name} {m['quant']}: decode tokens/s (batch x context), % of copy for weights + KV")
        rows: dict = {}
        for d in m["decode"]:
            rows.setdefault((d["batch"], d["context"]), {})[d["kv_dtype"]] = d
        for s in m["skipped"]:
            rows.setdefault((s["batch"], s["context"]), {})[s["kv_dtype"]] = s
        kvs = [k for k in KV_DTYPES]
        lines.append("  batch  context  " + "  ".join(f"{k:>18}" for k in kvs))
        for (b, c), cells in sorted(rows.items(), key=lambda x: (x[0][1], x[0][0])):
            def cell(d):
                if d is None:
                    return "-"
                if "tokens_per_s" in d:
                    return f"{d['tokens_per_s']:,.1f} ({100 * d['copy_fraction']:.0f}%)"
                return "no fit" if "does not fit" in d.get("reason", "") else d.get("reason", d.get("error", "?"))[:18]
            lines.append(f"  {b:5}  {c:7}  " + "  ".join(f"{cell(cells.get(k)):>18}" for k in kvs))
        if "largest_batch_32k" in m:
            lines.append(f"  largest batch at 32k: {m['largest_batch_32k']}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="kv_dtype.json")
    p.add_argument("--workdir", default="/tmp/rjax-kv-dtype", help="where the synthetic GGUFs are written")
    p.add_argument("--budget", type=float, default=420.0, help="seconds of measuring before the rest is skipped")
    p.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    p.add_argument("--models", default="llama,gemma", help="llama (llama-8b Q4_K), gemma (gemma3-1b Q4_K), or both")
    p.add_argument("--no-attention", action="store_true", help="skip the attention kernel measurement")
    p.add_argument("--contexts", default=None, help="only runs at these contexts (comma list)")
    p.add_argument("--batches", default=None, help="only runs at these batch sizes (comma list)")
    p.add_argument("--page-size", type=int, default=None,
                   help="read a paged cache of this many positions a page (pages in random order)")
    a = p.parse_args()
    models = [m for m in a.models.split(",") if m]
    if set(models) - {"llama", "gemma"}:
        p.error(f"--models takes llama and/or gemma, got {a.models!r}")
    kvs = [k for k in a.kv_dtypes.split(",") if k]
    batches = None if a.batches is None else [int(b) for b in a.batches.split(",")]
    out, workdir = Path(a.out), Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    deadline = t_start + a.budget
    dev = jax.devices()[0]
    result: dict = {"device": dev.device_kind, "jax_version": jax.__version__, "steps_per_dispatch": STEPS,
                    "kv_dtypes": kvs, "page_size": a.page_size, "status": "running",
                    "bytes_limit": (dev.memory_stats() or {}).get("bytes_limit")}

    def write():
        result["elapsed_s"] = time.perf_counter() - t_start
        out.write_text(json.dumps(result, indent=1))

    bw = measure_bandwidth()
    result["bandwidth"] = {k: bw[k] for k in ("gb_per_s", "probe", "probes", "nominal_gb_per_s")}
    say(f"copy bandwidth {bw['gb_per_s']:.0f} GB/s ({bw['probe']})")
    write()
    result["attention"] = []
    contexts = None if a.contexts is None else {int(c) for c in a.contexts.split(",")}
    for S in (() if a.no_attention else [S for S in ATTENTION_KEYS if contexts is None or S in contexts]):
        for B in batches or (1, 16):
            for kv in kvs:
                try:
                    r = attention_kernel(kv, B, S, bw["bytes_per_s"], page_size=a.page_size)
                except Exception as e:  # noqa: BLE001
                    r = dict(kv_dtype=kv, batch=B, keys=S, error=f"{type(e).__name__}: {str(e)[:500]}")
                    say(f"attention {kv} B={B} {S} keys: FAILED {r['error']}")
                else:
                    say(f"attention {kv} B={B} {S} keys: {r['us_per_call']:.1f} us, {r['gb_per_s']:.0f} GB/s "
                        f"({100 * r['copy_fraction']:.0f}% of copy)")
                result["attention"].append(r)
                write()
    for spec, largest in ((LLAMA, True), (GEMMA, False)):
        if (spec is LLAMA and "llama" not in models) or (spec is GEMMA and "gemma" not in models):
            continue
        try:
            bench_model(spec, kvs, workdir, bw["bytes_per_s"], result, write, deadline, largest,
                        contexts, a.page_size,
                        batches)
        except Exception as e:  # noqa: BLE001
            result.setdefault("errors", []).append(f"{spec['shape']}: {type(e).__name__}: {str(e)[:500]}")
            say(f"{spec['shape']}: FAILED {type(e).__name__}: {e}")
        write()
    result["status"] = "done"
    write()
    print(table(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
