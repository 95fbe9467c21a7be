"""The residual add + RMS norm left to the next product's kernel (a PendingNorm) against the
add + norm kernel followed by the product, at one row: GPU kernel time per layer.

    PYTHONPATH=. python3 benchmarks/pending_norm.py --out "$OUT/pending-norm.json"

Each case is a q/k/v or gate/up product of a model on the float kernel's CUDA-core tiles, fed
by the S partial sums of the product before it (the down or output product's split-K). Each
jitted call runs LAYERS distinct weights one after another, as a decode step does, so that the
weights stream from HBM; the time is the traced kernels' summed durations divided by LAYERS.
Arms: "two kernels" (add_rms_norm, then the product of its output), "pending" (the product's
default tiles) and "pending, N rows" (N weight rows per program: fewer programs, each of which
loads x's whole row), with K split for about 264 programs or not at all.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as QType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profile_decode import compile_concurrently, traced_kernel_times  # noqa: E402
from pallas_kernels.quant_matmul import gemv  # noqa: E402
from pallas_kernels.quant_matmul.kernel import fused_qmatmul  # noqa: E402
from pallas_kernels.quant_matmul.testing import random_qtensor  # noqa: E402
from pallas_kernels.rms_norm import PendingNorm, add_rms_norm  # noqa: E402

warnings.simplefilter("ignore", DeprecationWarning)
LAYERS = 16
# name: (type, N, K, parts of the producer, whether the consumer wants partials)
CASES = {
    "smollm2-qkv": (QType.Q4_1, 960, 576, 4, True),
    "smollm2-gate-up": (QType.Q4_1, 3072, 576, 3, False),
    "qwen-0.5b-qkv": (QType.Q4_0, 1152, 896, 3, True),
    "qwen-0.5b-gate-up": (QType.Q4_0, 9728, 896, 3, False),
}


def inputs(qtype, n, k, n_parts, seed=0):
    """LAYERS weights and LAYERS PendingNorms (distinct, so XLA cannot share one norm)."""
    r = np.random.default_rng(seed)
    w0 = random_qtensor(qtype, n, k, seed=seed)
    ws = [jax.tree.map(lambda a, i=i: jnp.asarray(np.roll(a, i, axis=0)), w0) for i in range(LAYERS)]
    xs = [PendingNorm(jnp.asarray(r.standard_normal((1, k)), jnp.float32),
                      jnp.asarray(r.standard_normal((n_parts, 1, k)), jnp.float32),
                      jnp.asarray(r.uniform(0.5, 1.5, k), jnp.float32), 1e-5, jnp.dtype(jnp.bfloat16))
          for _ in range(LAYERS)]
    return xs, ws


def program(arm, cfg, partials):
    def run(xs, ws):
        outs = []
        for x, w in zip(xs, ws):
            if arm == "two kernels":
                _, h = add_rms_norm(x.residual, x.parts, x.weight, x.eps, jnp.bfloat16)
                outs.append(fused_qmatmul(h, w, cfg, partials=partials))
            else:
                outs.append(fused_qmatmul(x, w, cfg, partials=partials))
        return outs
    return jax.jit(run)


def arms(qtype, n, k):
    """(arm, tiles): the two kernels on the product's tiles, the PendingNorm on the tiles the
    dispatch gives it, and on wider ones (fewer programs, so fewer loads of the whole row)."""
    cfg = gemv.default_gemv_config(qtype, 1, n, k)
    out = [("two kernels", cfg), ("pending", cfg)]
    for bn in (8, 16, 32, 64):
        if bn > cfg.block_n:
            out.append((f"pending, {bn} rows", gemv.gemv_config(qtype, 1, n, k, method="fma", block_n=bn,
                                                               programs=264)))
        if bn >= cfg.block_n and cfg.split_k > 1 or bn > cfg.block_n:
            out.append((f"pending, {bn} rows, 1 split", gemv.gemv_config(qtype, 1, n, k, method="fma", block_n=bn,
                                                                        programs=1)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="pending-norm.json")
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    t0 = time.perf_counter()
    jobs = []
    for name in a.cases.split(","):
        qtype, n, k, n_parts, partials = CASES[name]
        args = inputs(qtype, n, k, n_parts)
        for arm, c in arms(qtype, n, k):
            jobs.append((name, arm, c, args, program(arm, c, partials)))
    compiled = compile_concurrently([(fn, args) for *_, args, fn in jobs])
    print(f"compiled {len(jobs)} programs in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for (name, arm, cfg, args, _), exe in zip(jobs, compiled):
        row = dict(case=name, arm=arm, split_k=cfg.split_k, block_n=cfg.block_n)
        if isinstance(exe, str):
            row["error"] = exe
        else:
            total, count = traced_kernel_times(exe, args)
            row["us"] = sum(total.values()) / 1e3 / LAYERS
            row["kernels"] = sum(count.values()) / LAYERS
            row["by_kernel"] = {k: v / 1e3 / LAYERS for k, v in total.items()}
        rows.append(row)
        print(f"{name:18s} {arm:20s} {cfg.block_n:3d} rows, split {cfg.split_k}: " +
              (f"{row['us']:6.2f} us in {row['kernels']:.1f} kernels" if "us" in row else row["error"]), flush=True)
    Path(a.out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, layers=LAYERS, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
