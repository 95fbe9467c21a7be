"""Where a decode step's time goes on the GPU: kernel times from a profiler trace, by kernel.

    python benchmarks/profile_decode.py --out "$OUT" [--shape llama-8b --quant q4_k] [--batch 1]

Synthesizes the model (rjax synth), prefills one batch, then traces `engine.greedy_decode_loop`
(N steps in one dispatch, as `rjax bench` runs it) with `jax.profiler` and sums the GPU
kernels' durations by name. The report: wall time per step, the summed kernel time per step
(the rest is gaps between kernels: launches and host syncs), and the kernels that take it,
grouped by family (quantized matmul, attention, other fusions).

No peer: this is the diagnostic behind docs/kernels.md's per-layer split. Compare two trees,
or two settings of a kernel threshold (`--tuning FIELD=value`, a field of Tuning), by running
it in each, on one host. `kernel_times` (a trace's GPU kernel time by name) is also what
quant_matmul.py's `--timing kernels` uses.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from gguf_blocks.formats import QType
from pallas_kernels.quant_matmul import TUNING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def family(name: str) -> str:
    for key, fam in (("int8_gemv", "int8 GEMV"), ("rms_norm", "norm / int8 rounding"), ("quantize", "norm / int8 rounding"), ("qmatmul", "float quant matmul"), ("attention", "attention"),
                     ("attn", "attention"), ("gemm", "cuBLAS/cutlass"), ("gemv", "cuBLAS/cutlass"),
                     ("cutlass", "cuBLAS/cutlass"), ("memcpy", "copies"), ("memset", "copies")):
        if key in name.lower():
            return fam
    return "XLA fusions"


def kernel_times(trace_dir: str, device_prefix: str = "/device:GPU") -> tuple[collections.Counter, collections.Counter]:
    import jax

    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    data = jax.profiler.ProfileData.from_file(files[0])
    total, count = collections.Counter(), collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith(device_prefix):
            continue
        # Kernels sit on the per-stream lines; "XLA Ops"/"XLA Modules" lines repeat them.
        lines = [l for l in plane.lines if "stream" in l.name.lower()
                 and ("compute" in l.name.lower() or "memcpy" not in l.name.lower())]
        for line in lines:
            for ev in line.events:
                total[ev.name] += ev.duration_ns
                count[ev.name] += 1
    return total, count


def compile_concurrently(calls: list, workers: int = 14) -> list:
    """Lower and compile each (jitted fn, args) in a thread pool: the executable, or the error
    as a string (a tile that does not compile is a result, not a failure of the sweep)."""
    import concurrent.futures

    def compile_one(call):
        fn, args = call
        try:
            return fn.lower(*args).compile()
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {str(e)[:200]}"

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(compile_one, calls))


def traced_kernel_times(exe, args) -> tuple[collections.Counter, collections.Counter]:
    """kernel_times of one call of exe(*args), after a warm-up call, in a temporary trace folder."""
    import jax

    with tempfile.TemporaryDirectory() as trace:
        jax.block_until_ready(exe(*args))
        with jax.profiler.trace(trace):
            jax.block_until_ready(exe(*args))
        return kernel_times(trace)


def tuning_from(items):
    """The default Tuning with fields changed: `FIELD=value`, or `FIELD[TYPE]=value` for the entry
    of a per-type field (TYPE a GGML type's name, e.g. int8_max_m[Q4_K]=8)."""
    changes: dict = {}
    for item in items:
        target, _, value = item.partition("=")
        name, _, key = target.rstrip("]").partition("[")
        if not hasattr(TUNING, name) or not value:
            raise SystemExit(f"--tuning {item!r}: expected FIELD=value or FIELD[TYPE]=value, FIELD one of "
                             f"{', '.join(f.name for f in dataclasses.fields(TUNING))}")
        v = int(value) if value.lstrip("-").isdigit() else {"true": True, "false": False}.get(value.lower())
        if v is None:
            raise SystemExit(f"--tuning {item!r}: the value must be an integer, true or false")
        if key:
            if key not in QType.__members__:
                raise SystemExit(f"--tuning {item!r}: {key!r} is not a GGML type name")
            changes.setdefault(name, {})[QType[key]] = v
        else:
            changes[name] = v
    return TUNING.replace(**changes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "profile-out"))
    p.add_argument("--shape", default="llama-8b")
    p.add_argument("--quant", default="q4_k")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--layers", type=int, default=None, help="override the layer count (smoke tests)")
    p.add_argument("--tuning", action="append", default=[], metavar="FIELD[TYPE]=value",
                   help="run the step with a kernel threshold changed (pallas_kernels.quant_matmul.Tuning)")
    p.add_argument("--tag", default="", help="appended to the report's file name")
    a = p.parse_args()
    tuning = tuning_from(a.tuning)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import rjax
    from rjax.engine import steps as engine
    from rjax.loading.synth import write_synthetic
    from rjax.math.cache import init_cache
    from rjax.math.sampling import SamplingParams
    from rjax.runtime.generation import activation_dtype

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = write_synthetic(Path("/tmp") / f"profile-{a.shape}-{a.quant}.gguf", a.shape, a.quant, seed=0,
                           n_layers=a.layers)
    model = rjax.load(path, progress=False)
    cfg, params = model.config, model.params
    dtype = activation_dtype()
    b, S = a.batch, a.prompt_len + 4 * a.steps
    rng = np.random.default_rng(0)
    tokens, lengths = engine.pad_prompts([list(rng.integers(0, cfg.vocab_size, a.prompt_len)) for _ in range(b)])
    sp = SamplingParams.make(b)
    key = jax.random.key(0)
    cache = init_cache(cfg, b, S, dtype)
    first, cache = engine.prefill_and_sample(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths), None, key, sp)
    stop = jnp.asarray([-1], jnp.int32)
    state = engine.initial_state(first, jnp.full((b,), 3 * a.steps, jnp.int32), stop, key, cache)
    toks, state, cache = engine.greedy_decode_loop(cfg, params, cache, state, sp, stop, a.steps, tuning)   # compile
    np.asarray(toks)
    # A fresh directory per run: kernel_times reads the one trace file it finds.
    with tempfile.TemporaryDirectory(prefix="rjax-trace-") as trace:
        t0 = time.perf_counter()
        with jax.profiler.trace(trace):
            toks, state, cache = engine.greedy_decode_loop(cfg, params, cache, state, sp, stop, a.steps, tuning)
            np.asarray(toks)
        wall = time.perf_counter() - t0
        total, count = kernel_times(trace)
    steps = a.steps
    kernel_us = sum(total.values()) / 1e3 / steps
    fams = collections.Counter()
    fam_n = collections.Counter()
    for name, ns in total.items():
        fams[family(name)] += ns
        fam_n[family(name)] += count[name]
    report = dict(shape=a.shape, quant=a.quant, batch=b, tuning=a.tuning, steps=steps, wall_us_per_step=wall * 1e6 / steps,
                  kernel_us_per_step=kernel_us, kernels_per_step=sum(count.values()) / steps,
                  families={f: dict(us_per_step=ns / 1e3 / steps, kernels_per_step=fam_n[f] / steps)
                            for f, ns in fams.most_common()},
                  top=[dict(name=n[:120], us_per_step=ns / 1e3 / steps, calls_per_step=count[n] / steps)
                       for n, ns in total.most_common(a.top)])
    print(f"{a.shape} {a.quant} B={b} {' '.join(a.tuning)}: {report['wall_us_per_step']:.0f} us/step wall (profiled), "
          f"{kernel_us:.0f} us/step in {report['kernels_per_step']:.0f} kernels")
    for f, v in report["families"].items():
        print(f"  {f:22s} {v['us_per_step']:8.1f} us/step  {v['kernels_per_step']:6.1f} kernels/step")
    for t in report["top"]:
        print(f"    {t['us_per_step']:8.1f} us  x{t['calls_per_step']:5.1f}  {t['name']}")
    (out / f"profile-{a.shape}-{a.quant}-b{b}{a.tag}.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
