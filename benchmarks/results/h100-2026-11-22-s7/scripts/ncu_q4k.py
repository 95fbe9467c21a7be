"""The Q4_K int8 GEMV on producer-rounded x (14336x4096), a few times, for ncu. argv[1]: bytes|words"""
import sys, jax, jax.numpy as jnp
from gguf import GGMLQuantizationType as QType
from benchmarks.quant_matmul import device_qtensor
from pallas_kernels.quant_matmul.int8_gemv import int8_gemv, quantize_x
from pallas_kernels.quant_matmul.gemv import default_int8_config
from rjax.quant.qtensor import QTensor
n, k = 14336, 4096
w = device_qtensor(QType.Q4_K, n, k, jax.random.key(0))
if len(sys.argv) > 1 and sys.argv[1] == "words":
    qs = w.planes.qs
    w = QTensor(w.planes._replace(qs=jax.lax.bitcast_convert_type(qs.reshape(*qs.shape[:-1], -1, 4), jnp.int32)), w.qtype, w.shape)
x = jax.random.normal(jax.random.key(1), (1, k), jnp.float32).astype(jnp.bfloat16)
xq = jax.jit(quantize_x)(x)
cfg = default_int8_config(QType.Q4_K, 1, n, k)
f = jax.jit(lambda xq, w: int8_gemv(xq, w, cfg))
for _ in range(3):
    jax.block_until_ready(f(xq, w))
print(cfg, 'done')
