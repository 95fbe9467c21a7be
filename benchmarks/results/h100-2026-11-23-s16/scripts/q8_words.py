"""Q8_0 quants as bytes (the GPU model's layout now) against int32 words: the M=1 int8 GEMV and
the M=16 wgmma kernel, GPU kernel time per product (all kernels, and the product's own)."""
import sys, json, os
import jax, jax.numpy as jnp
from gguf import GGMLQuantizationType as QType
sys.path.insert(0, ".")
from benchmarks.int8_gemv_tiles import SHAPES, streamed_operands
from benchmarks.profile_decode import compile_concurrently, traced_kernel_times
from pallas_kernels.int8_activations import quantize_rows
from pallas_kernels.quant_matmul.gemv import default_int8_config
from pallas_kernels.quant_matmul.int8_gemv import int8_gemv
from pallas_kernels.quant_matmul import wgmma_skinny
from rjax.quant.words import as_words

qt = QType.Q8_0
jobs = []
for name in ("8b-up" if False else "8b-gateup", "8b-down", "8b-o", "1b-gateup", "1b-down"):
    n, k = SHAPES[name]
    ws, x1 = streamed_operands(qt, n, k)
    for layout in ("bytes", "words"):
        wl = ws if layout == "bytes" else [as_words(w) for w in ws]
        c = default_int8_config(qt, 1, n, k)
        jobs.append((name, layout, 1, jax.jit(lambda x, ws, c=c: [int8_gemv(quantize_rows(x), w, c, partials=True) for w in ws]), (x1, wl)))
        x16 = jax.random.normal(jax.random.key(16), (16, k), jnp.float32).astype(jnp.bfloat16)
        jobs.append((name, layout, 16, jax.jit(lambda x, ws: [wgmma_skinny.wgmma_matmul(x, w, partials=True) for w in ws]), (x16, wl)))
compiled = compile_concurrently([(j[3], j[4]) for j in jobs], 14)
rows = []
for (name, layout, m, fn, args), exe in zip(jobs, compiled):
    if isinstance(exe, str):
        print(name, layout, m, "ERROR", exe[:300]); continue
    total, _ = traced_kernel_times(exe, args)
    cps = len(args[1])
    own = sum(t for nm, t in total.items() if "int8_gemv" in nm or "wgmma" in nm) / 1e3 / cps
    allk = sum(total.values()) / 1e3 / cps
    rows.append(dict(shape=name, layout=layout, m=m, us=own, us_all=allk, kernels={k: v / 1e3 / cps for k, v in total.items()}))
    print(f"{name:10s} {layout:5s} M={m:<2d} own {own:7.2f} us  all {allk:7.2f} us", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "q8-words.json"), "w"), indent=1)
