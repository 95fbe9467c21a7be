"""Probe: the Mosaic GPU wgmma Q4_K skinny GEMM against the Triton bf16x2 tiles and the M=1 int8 GEMV."""
import sys, time, json, warnings
from pathlib import Path
import jax, jax.numpy as jnp
from gguf import GGMLQuantizationType as QType
sys.path.insert(0, ".")
warnings.simplefilter("ignore")
from benchmarks.int8_gemv_tiles import streamed_operands
from benchmarks.profile_decode import compile_concurrently, traced_kernel_times
from benchmarks.quant_matmul import measure_ceilings, wbytes
from pallas_kernels.int8_activations import quantize_rows
from pallas_kernels.quant_matmul.gemv import bf16x2_config, default_int8_config
from pallas_kernels.quant_matmul.int8_gemv import int8_gemv
from pallas_kernels.quant_matmul.kernel import fused_qmatmul
from pallas_kernels.quant_matmul.wgmma_skinny import wgmma_q4_k, WgmmaConfig
from rjax.quant.reference import dequantize

SHAPES = {"8b-up": (14336, 4096), "8b-down": (4096, 14336), "8b-qkv": (6144, 4096), "1b-gateup": (16384, 2048)}
names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(SHAPES)
ms = [int(v) for v in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["16"])]
cfgs = [tuple(int(t) for t in v.split(':')) for v in (sys.argv[3].split(',') if len(sys.argv) > 3 else ['4:1:0'])]
hbm, peak = measure_ceilings()
print(f"HBM copy {hbm:.0f} GB/s", flush=True)
qt = QType.Q4_K
jobs = []
for name in names:
    n, k = SHAPES[name]
    ws, x1 = streamed_operands(qt, n, k)
    c = default_int8_config(qt, 1, n, k)
    jobs.append(dict(shape=name, m=1, kind="int8", cfg=str(c), args=(x1, ws), w0=ws[0], copies=len(ws),
                     fn=jax.jit(lambda x, ws, c=c: [int8_gemv(quantize_rows(x), w, c, partials=True) for w in ws])))
    for m in ms:
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
        cfg = bf16x2_config(ws[0], m, jnp.bfloat16)
        jobs.append(dict(shape=name, m=m, kind="bf16x2", cfg=str(cfg), args=(x, ws), w0=ws[0], copies=len(ws),
                         fn=jax.jit(lambda x, ws, c=cfg: [fused_qmatmul(x, w, c) for w in ws])))
        for bps, pf, st in cfgs:
            if (k // 256) % bps:
                continue
            wc = WgmmaConfig(bps, pf, st)
            jobs.append(dict(shape=name, m=m, kind="wgmma", cfg=str(wc), args=(x, ws), w0=ws[0], copies=len(ws),
                             fn=jax.jit(lambda x, ws, c=wc: [wgmma_q4_k(x, w, c) for w in ws])))
t0 = time.perf_counter()
compiled = compile_concurrently([(j["fn"], j["args"]) for j in jobs], 8)
print(f"compiled {len(jobs)} in {time.perf_counter()-t0:.0f}s", flush=True)
rows = []
shown = set()
for j, exe in zip(jobs, compiled):
    row = {k: j[k] for k in ("shape", "m", "kind", "cfg")}
    if isinstance(exe, str):
        row["error"] = exe[-2000:]
        print("ERROR", row, flush=True); rows.append(row); continue
    try:
        total, _ = traced_kernel_times(exe, j["args"])
        x, ws = j["args"]
        out = exe(x, ws)[0]
        if j["kind"] == "int8":
            out = out.sum(axis=0)
        ref = x.astype(jnp.float32) @ dequantize(j["w0"]).astype(jnp.float32).T
        row["rel_err"] = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
        print("ERROR", row, flush=True); rows.append(row); continue
    if j["kind"] not in shown:
        shown.add(j["kind"]); print(j["kind"], {k: v / 1e3 / j["copies"] for k, v in total.items()})
    n, k = SHAPES[j["shape"]]
    kern = [t for nm, t in total.items() if not nm.startswith(("loop_", "input_", "wrapped_", "copy", "Memcpy", "memcpy"))]
    row["us"] = sum(kern) / 1e3 / j["copies"]
    row["us_all"] = sum(total.values()) / 1e3 / j["copies"]
    row["hbm"] = wbytes(qt, n, k) / row["us"] / 1e3 / hbm
    print(f"{j['shape']:10s} M={j['m']:<3d} {j['kind']:7s} {row['us']:7.2f} us (all {row['us_all']:.2f}, {row['hbm']:.0%}) err {row['rel_err']:.1e} {j['cfg']}", flush=True)
    rows.append(row)
import os
Path(os.environ.get("OUT", "/tmp"), "wg1.json").write_text(json.dumps(dict(hbm=hbm, rows=rows), indent=1))
