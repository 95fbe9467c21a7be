"""Q4_K int8 GEMV kernel time (summed GPU kernel time, traced), plane layouts x activation kinds.
usage: q4k_var.py TAG   (run with the tree under test first on PYTHONPATH)"""
import sys, json, jax, jax.numpy as jnp
import pallas_kernels
from gguf import GGMLQuantizationType as QType
from benchmarks.quant_matmul import device_qtensor, kernel_time, _copies, wbytes, _ref_product
from pallas_kernels.quant_matmul.int8_gemv import int8_gemv, quantize_x
from pallas_kernels.quant_matmul.gemv import default_int8_config
from rjax.quant.qtensor import QTensor
tag = sys.argv[1]
print(tag, pallas_kernels.__file__, flush=True)
shapes = [(14336, 4096), (4096, 14336), (28672, 4096), (6144, 4096), (4096, 4096), (16384, 2048), (2048, 8192)]
if len(sys.argv) > 2:
    shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[2].split(",")]

def words(w):
    qs = w.planes.qs
    return QTensor(w.planes._replace(qs=jax.lax.bitcast_convert_type(qs.reshape(*qs.shape[:-1], -1, 4), jnp.int32)), w.qtype, w.shape)

rows = []
for n, k in shapes:
    nc = _copies(wbytes(QType.Q4_K, n, k))
    base = [device_qtensor(QType.Q4_K, n, k, jax.random.key(i)) for i in range(nc)]
    x = jax.random.normal(jax.random.key(99), (1, k), jnp.float32).astype(jnp.bfloat16)
    ref = _ref_product(x, base[0])
    cfg = default_int8_config(QType.Q4_K, 1, n, k)
    for layout in ("bytes", "words"):
        ws = base if layout == "bytes" else [jax.jit(words)(w) for w in base]
        for xk in ("raw", "xq"):
            xx = x if xk == "raw" else jax.jit(quantize_x)(x)
            f = jax.jit(lambda x, ws: [int8_gemv(x, w, cfg) for w in ws])
            try:
                t, out = kernel_time(f, xx, ws)
                own = kernel_time.own_us
                err = float(jnp.linalg.norm(out[0].astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
            except Exception as e:
                print(tag, n, k, layout, xk, "ERROR", repr(e)[:300], flush=True)
                continue
            r = dict(tag=tag, N=n, K=k, layout=layout, x=xk, us=t * 1e6, own_us=own, rel_err=err, cfg=str(cfg))
            rows.append(r)
            print(f"{tag:10s} {n}x{k} {layout:5s} {xk:3s} total {t*1e6:7.1f} us  gemv {own:7.1f} us  err {err:.2e}", flush=True)
json.dump(rows, open(f"/tmp/q4kvar-{tag}.json", "w"))
