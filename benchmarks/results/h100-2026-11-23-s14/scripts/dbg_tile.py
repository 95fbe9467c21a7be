import numpy as np, jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from gguf import GGMLQuantizationType as QType
from pallas_kernels.quant_matmul import tiles
from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul
from pallas_kernels.quant_matmul.testing import random_qtensor, dequantized_product, rel_error
from rjax.model import gpu_weight_layout

n, k = 64, 512
w = gpu_weight_layout(jax.tree.map(jnp.asarray, random_qtensor(QType.Q4_K, n, k, seed=1)))
views = tiles.Q4_K_CHUNKS_BF16X2.views(w.planes)
print([(v.shape, v.dtype) for v in views])

def tile_out(interpret, bkb=2, bn=32):
    def kern(*refs):
        *w_refs, o_ref = refs
        rows, blocks = pl.ds(0, bn), pl.ds(0, bkb)
        mask = jnp.ones((bn, bkb), jnp.bool_)
        lo, hi = tiles.Q4_K_CHUNKS_BF16X2.tile(w_refs, rows, blocks, mask, interpret)
        o_ref[0] = lo
        o_ref[1] = hi
    return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((2, bn, bkb, 4, 32), jnp.bfloat16), interpret=interpret)(*views)

g = np.asarray(tile_out(False).astype(jnp.float32)); r = np.asarray(tile_out(True).astype(jnp.float32))
print("tile equal", np.array_equal(g, r), "max diff", np.abs(g - r).max(), "ref max", np.abs(r).max())
bad = np.argwhere(g != r)
print("first bad", bad[:5], g[tuple(bad[0])] if len(bad) else None, r[tuple(bad[0])] if len(bad) else None)
print("g[0,0,0,:8]", g[0, 0, 0, :8]); print("r[0,0,0,:8]", r[0, 0, 0, :8])

x = jnp.asarray(np.random.default_rng(0).standard_normal((16, k)), jnp.bfloat16)
for cfg in [TileConfig(16, 32, 1, dequant="bf16x2"), TileConfig(16, 64, 2, split_k=1, dequant="bf16x2")]:
    ref = dequantized_product(np.asarray(x.astype(jnp.float32)), random_qtensor(QType.Q4_K, n, k, seed=1))
    print(cfg, "gpu", rel_error(fused_qmatmul(x, w, cfg), ref), "interp", rel_error(fused_qmatmul(x, w, cfg, interpret=True), ref))
