"""Correctness, not speed: the whole model on the GPU (Pallas kernels, bfloat16 and float32)
against the CPU reference path (float32) in the same run.

    python benchmarks/gpu_check.py --out "$OUT" [--shape smollm2-135m --quant q4_1]

Synthesizes a model of a real shape, runs a batch of prompts of different lengths through
prefill and greedy decode steps on the default backend, then runs the same on the CPU in a
child process (JAX_PLATFORMS=cpu: the reference dequantize-then-dot and reference attention). The GPU
runs twice, with float32 and with bfloat16 activations, fed the CPU's greedy tokens, and the
report gives the logits' max |Δ| relative to max |logit| and how often the top token agrees.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_model(path: str, steps: int, seed: int, dtype_name: str, feed: np.ndarray | None = None) -> dict:
    """Prefill a batch, then `steps` decode steps fed with `feed` [B, steps] (teacher forcing,
    so both backends see the same tokens) or, without it, with the greedy tokens."""
    import jax
    import jax.numpy as jnp

    from rjax.engine import steps as engine
    from rjax.loading.loaders import for_backend
    from rjax.loading.loaders.gguf import load_gguf
    from rjax.math.cache import init_cache

    cfg, params, _ = load_gguf(path, progress=False)
    params = for_backend(params)   # as rjax.load arranges them (a no-op on the CPU)
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(0, min(cfg.vocab_size, 250), n)) for n in (100, 37, 250)]
    cache = init_cache(cfg, len(prompts), 512, jnp.dtype(dtype_name))
    t, l = engine.pad_prompts(prompts)
    t0 = time.perf_counter()
    logits, cache = engine.prefill(cfg, params, cache, jnp.asarray(t), jnp.asarray(l))
    out = [np.asarray(logits)]
    first_call = time.perf_counter() - t0
    toks = [np.asarray(jnp.argmax(logits, -1))]
    for i in range(steps):
        x = toks[-1] if feed is None else feed[:, i]
        logits, cache = engine.decode_step(cfg, params, cache, jnp.asarray(x, jnp.int32))
        out.append(np.asarray(logits))
        toks.append(np.asarray(jnp.argmax(logits, -1)))
    return dict(backend=jax.default_backend(), first_call_s=first_call, logits=np.stack(out), tokens=np.stack(toks, 1))


def compare(ref: dict, got: dict) -> dict:
    r, g = ref["logits"].astype(np.float64), got["logits"].astype(np.float64)
    rel = np.abs(g - r).max(axis=-1) / np.abs(r).max(axis=-1)  # [steps+1, B]
    top5 = np.argsort(-r, axis=-1)[..., :5]
    in_top5 = (top5 == g.argmax(-1)[..., None]).any(-1)
    return dict(prefill_rel_err_max=float(rel[0].max()), decode_rel_err_max=float(rel[1:].max()),
                decode_rel_err_median=float(np.median(rel[1:])),
                top1_agreement=float((g.argmax(-1) == r.argmax(-1)).mean()),
                gpu_top1_in_cpu_top5=float(in_top5.mean()), first_call_s=got["first_call_s"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-check-out"))
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--quant", default="q4_1")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    out = Path(a.out)
    if a.child:  # the CPU reference run, greedy
        r = run_model(a.child, a.steps, 0, "float32")
        np.savez(out / f"cpu-{a.shape}-{a.quant}.npz", logits=r["logits"], tokens=r["tokens"])
        return
    from rjax.loading.synth import write_synthetic

    out.mkdir(parents=True, exist_ok=True)
    path = f"/tmp/check-{a.shape}-{a.quant}.gguf"
    write_synthetic(path, a.shape, a.quant, seed=0, n_layers=a.layers)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, __file__, "--child", path, "--out", str(out), "--steps", str(a.steps),
                    "--shape", a.shape, "--quant", a.quant], env=env, check=True)
    cpu = dict(np.load(out / f"cpu-{a.shape}-{a.quant}.npz"))
    cpu["first_call_s"] = 0.0
    result = dict(shape=a.shape, quant=a.quant, steps=a.steps)
    for dtype in ("float32", "bfloat16"):
        got = run_model(path, a.steps, 0, dtype, feed=cpu["tokens"][:, :-1])
        result[dtype] = compare(cpu, got)
    (out / f"gpu_check-{a.shape}-{a.quant}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
