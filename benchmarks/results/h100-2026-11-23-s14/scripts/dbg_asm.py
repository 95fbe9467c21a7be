import numpy as np, jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from pallas_kernels.quant_matmul.tiles import nibbles_bf16
jnp.set_printoptions(linewidth=200)

def run(q, s_lo, b_lo, s_hi, b_hi, interpret):
    def k(q_ref, s_ref, b_ref, s2_ref, b2_ref, lo_ref, hi_ref):
        lo, hi = nibbles_bf16(q_ref[...], s_ref[...], b_ref[...], s2_ref[...], b2_ref[...], interpret)
        lo_ref[...] = lo
        hi_ref[...] = hi
    out = jax.ShapeDtypeStruct(q.shape, jnp.bfloat16)
    return pl.pallas_call(k, out_shape=(out, out), interpret=interpret)(q, s_lo, b_lo, s_hi, b_hi)

rng = np.random.default_rng(0)
q = jnp.asarray(rng.integers(0, 256, (16, 32)), jnp.uint8)
one = jnp.ones((16, 32), jnp.float32)
for s, b in [(1.0, 0.0), (2.0, 1.0)]:
    args = (q, one * s, one * b, one * s, one * b)
    g = [np.asarray(a.astype(jnp.float32)) for a in run(*args, False)]
    r = [np.asarray(a.astype(jnp.float32)) for a in run(*args, True)]
    print("s, b", s, b, "lo ok", np.array_equal(g[0], r[0]), "hi ok", np.array_equal(g[1], r[1]))
    print("q  ", np.asarray(q)[0, :8])
    print("lo gpu", g[0][0, :8], "ref", r[0][0, :8])
    print("hi gpu", g[1][0, :8], "ref", r[1][0, :8])
s_var = jnp.asarray(rng.uniform(0.5, 2, (16, 32)), jnp.float32)
g = [np.asarray(a.astype(jnp.float32)) for a in run(q, s_var, one * 0, s_var, one * 0, False)]
r = [np.asarray(a.astype(jnp.float32)) for a in run(q, s_var, one * 0, s_var, one * 0, True)]
print("varying s: lo ok", np.array_equal(g[0], r[0]), np.abs(g[0] - r[0]).max())
