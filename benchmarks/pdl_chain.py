"""Gap between dependent Pallas kernels, with and without programmatic dependent launch (PDL).

A chain of small Triton-lowered Pallas kernels, each reading what the one before wrote, runs in a
jitted loop. Variants of the kernel:

- plain: no grid-dependency control;
- wait: `griddepcontrol.wait` first (inline PTX), the loads indexed through its result so that
  none is issued before it;
- wait+trigger: the same, then `griddepcontrol.launch_dependents`, so the next kernel may be
  scheduled while this one runs.

The wait only matters if XLA launches the kernel with the programmatic-serialization attribute
(or a programmatic edge in its command buffer); each variant therefore runs under
`--xla_gpu_enable_pdl=true` and `=false`, each in a fresh process. The report gives microseconds
per kernel and checks the chain's result, so a launch that broke the dependency shows as wrong.

    python benchmarks/pdl_chain.py --out pdl.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = ("plain", "wait", "wait+trigger", "xla")
SHAPES = {"tiny": (1, 256), "wide": (264, 8192)}  # programs, floats per program


def _child(variant: str, shape: str, n_iter: int, per_iter: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    programs, width = SHAPES[shape]

    def gate(index, asm):
        [out] = plgpu.elementwise_inline_asm(
            asm + "\n\tmov.u32 $0, $1;", args=[jnp.full((1,), index, jnp.int32)], constraints="=r,r",
            pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
        return jnp.sum(out)  # a 0-d tensor is not the scalar Triton indexes with

    def kernel(x_ref, o_ref):
        pid = pl.program_id(0)
        if variant != "plain":
            pid = gate(pid, "griddepcontrol.wait;")
        if variant == "wait+trigger":
            pid = gate(pid, "griddepcontrol.launch_dependents;")
        block = pl.ds(pl.multiple_of(pid * width, width), width)
        o_ref[block] = x_ref[block] * 0.5 + 1.0

    def pallas_op(x):
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(programs,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)], out_specs=pl.BlockSpec(memory_space=pl.ANY),
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), name=f"chain_{variant}")(x)

    def xla_op(x):
        return x * 0.5 + 1.0

    op = xla_op if variant == "xla" else pallas_op

    def body(_, x):
        for _ in range(per_iter):
            x = op(x)
        return x

    f = jax.jit(lambda x: jax.lax.fori_loop(0, n_iter, body, x))
    x = jnp.zeros((programs * width,), jnp.float32)
    y = f(x).block_until_ready()
    # x <- x/2 + 1 from 0 converges to 2; after n steps it is 2 - 2**(1-n).
    steps = n_iter * per_iter
    want = 2.0 - 2.0 ** (1 - min(steps, 60))
    ok = bool(jnp.allclose(y, want, rtol=1e-6))
    times = []
    for _ in range(7):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    times.sort()
    return dict(us_per_kernel=times[len(times) // 2] / steps * 1e6, correct=ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=16)
    ap.add_argument("--per-iter", type=int, default=100)
    ap.add_argument("--out")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "SHAPE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(*a.child, a.iters, a.per_iter)))
        return
    rows = []
    for shape in a.shapes.split(","):
        for variant in a.variants.split(","):
            for pdl in ("true", "false"):
                env = dict(os.environ)
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_gpu_enable_pdl={pdl}").strip()
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", variant, shape, "--iters", str(a.iters),
                     "--per-iter", str(a.per_iter)], env=env, capture_output=True, text=True, timeout=600)
                row = dict(shape=shape, variant=variant, pdl=pdl)
                try:
                    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                except (IndexError, json.JSONDecodeError):
                    row["error"] = (proc.stderr or proc.stdout)[-2000:]
                rows.append(row)
                shown = (f"{row['us_per_kernel']:.2f} us/kernel, correct={row['correct']}" if "us_per_kernel" in row
                         else "error: " + row["error"].strip().splitlines()[-1][:200])
                print(f"{shape:5} {variant:13} pdl={pdl:5} {shown}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
