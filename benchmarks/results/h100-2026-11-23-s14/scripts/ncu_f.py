import sys, jax, jax.numpy as jnp
from gguf import GGMLQuantizationType as QType
sys.path.insert(0, ".")
from benchmarks.quant_matmul import device_qtensor
from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul
w = device_qtensor(QType.Q4_K, 14336, 4096, jax.random.key(0))
x = jax.random.normal(jax.random.key(1), (16, 4096), jnp.float32).astype(jnp.bfloat16)
cfgs = {"f32": TileConfig(16, 64, 1, split_k=3), "bf16x2": TileConfig(16, 64, 1, split_k=2, dequant="bf16x2")}
for name in sys.argv[1].split(","):
    jax.block_until_ready(fused_qmatmul(x, w, cfgs[name]))
