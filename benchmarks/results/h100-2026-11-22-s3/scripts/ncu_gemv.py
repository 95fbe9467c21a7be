"""Run the production decode products a few times, for ncu. Dev helper."""
import sys, jax, jax.numpy as jnp
sys.path.insert(0, '.')
from gguf import GGMLQuantizationType as QType
from benchmarks.quant_matmul import device_qtensor
from pallas_kernels.quant_matmul import qmatmul
for spec in sys.argv[1:]:
    t, n, k = spec.split(':'); n, k = int(n), int(k)
    w = device_qtensor(QType[t], n, k, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, k), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(qmatmul)
    for _ in range(3):
        jax.block_until_ready(f(x, w))
    print(spec, 'done')
