"""Dump XLA's compiled output (PTX) for the Q4_K int8 GEMV and decode attention; time them."""
import os, sys, glob, subprocess
out = os.environ["OUT"]
dump = "/tmp/xdump"
os.environ["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
sys.path.insert(0, ".")
import jax, jax.numpy as jnp
sys.path.insert(0, "benchmarks")
from quant_matmul import device_qtensor
from gguf import GGMLQuantizationType as QType
from pallas_kernels.quant_matmul.int8_gemv import int8_gemv, quantize_x
from pallas_kernels.quant_matmul.gemv import default_int8_config
n, k = 14336, 4096
w = device_qtensor(QType.Q4_K, n, k, jax.random.key(0))
x = jax.random.normal(jax.random.key(1), (1, k), jnp.bfloat16)
cfg = default_int8_config(QType.Q4_K, 1, n, k)
print(cfg)
xq = jax.jit(quantize_x)(x)
f = jax.jit(lambda xq, w: int8_gemv(xq, w, cfg))
f(xq, w).block_until_ready()
g = jax.jit(lambda x, w: int8_gemv(x, w, cfg))
g(x, w).block_until_ready()
files = sorted(glob.glob(dump + "/*"))
print(len(files), "dump files")
for p in files:
    if p.endswith(".ptx"):
        print(p, os.path.getsize(p))
