"""Host cost per kernel inside a jitted loop: Pallas Triton kernels vs XLA fusions, with and without command buffers."""
import functools, json, os, sys, time
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

def tri(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + 1.0

def tri_call(x):
    return pl.pallas_call(tri, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
                          compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1))(x)

def xla_op(x):
    return jnp.sin(x) * 2.0 + x[::-1]

def loop(kind, n_iter, per_iter):
    op = tri_call if kind == "pallas" else xla_op
    def body(i, x):
        for _ in range(per_iter):
            x = op(x)
        return x
    return jax.jit(lambda x: jax.lax.fori_loop(0, n_iter, body, x))

def loop_while(kind, n_iter, per_iter):
    op = tri_call if kind == "pallas" else xla_op
    def body(c):
        i, x = c
        for _ in range(per_iter):
            x = op(x)
        return i + 1, x
    return jax.jit(lambda x: jax.lax.while_loop(lambda c: (c[0] < n_iter) & (c[1][0] < 1e30), body, (0, x))[1])

res = {}
x = jnp.zeros((256,), jnp.float32)
for name, mk in (("fori", loop), ("while", loop_while)):
    for kind in ("pallas", "xla"):
        f = mk(kind, 16, 100)
        f(x).block_until_ready()
        t = time.perf_counter(); 
        for _ in range(5): f(x).block_until_ready()
        dt = (time.perf_counter() - t) / 5
        res[f"{name}-{kind}"] = dt / 1600 * 1e6
print(os.environ.get("XLA_FLAGS", ""), json.dumps({k: round(v, 2) for k, v in res.items()}))
