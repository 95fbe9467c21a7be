"""Q6_K output-layer shapes: float kernel (production) against the int8 GEMV on bytes and on words, producer-rounded x."""
import jax, jax.numpy as jnp
from gguf import GGMLQuantizationType as QType
from benchmarks.quant_matmul import device_qtensor, kernel_time, _ref_product
from pallas_kernels.quant_matmul import qmatmul
from pallas_kernels.quant_matmul.int8_gemv import int8_gemv, quantize_x, Int8GemvConfig
from rjax.quant.words import as_words
for n, k in ((128256, 4096), (128256, 2048)):
    ws = [device_qtensor(QType.Q6_K, n, k, jax.random.key(i)) for i in range(2)]
    x = jax.random.normal(jax.random.key(9), (1, k), jnp.float32).astype(jnp.bfloat16)
    ref = _ref_product(x, ws[0])
    xq = jax.jit(quantize_x)(x)
    def show(name, f, xx, wl):
        t, out = kernel_time(jax.jit(f), xx, wl)
        err = float(jnp.linalg.norm(out[0].astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        print(f"{n}x{k} {name:40s} {t*1e6:7.1f} us  {ws[0].nbytes/t/1e9:6.0f} GB/s err {err:.1e}", flush=True)
    show("float qmatmul (bytes)", lambda x, wl: [qmatmul(x, w) for w in wl], x, ws)
    wws = [jax.jit(as_words)(w) for w in ws]
    for bn in (8, 16, 32):
        for bk in (1, 2, 4):
            cfg = Int8GemvConfig(block_n=bn, block_k=bk, split_k=1)
            for lay, wl in (("bytes", ws), ("words", wws)):
                try:
                    show(f"int8 {lay} bn={bn} bk={bk}", lambda x, wl, cfg=cfg: [int8_gemv(x, w, cfg) for w in wl], xq, wl)
                except Exception as e:
                    print(n, k, lay, bn, bk, "ERROR", repr(e)[:200], flush=True)
