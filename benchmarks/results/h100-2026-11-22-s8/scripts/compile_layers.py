"""Compile time against layer count (a slice of the model's layers), for prefill_and_sample and decode_loop."""
import dataclasses, sys, time, json
import jax, jax.numpy as jnp
from rjax.bench import load_for_bench
from rjax import engine
from rjax.cache import init_cache
from rjax.sampling import SamplingParams

path, tag, out = sys.argv[1], sys.argv[2], sys.argv[3]
if "nomgpu" in tag:
    import pallas_kernels.attention as A
    A.mgpu_prefill_supports = lambda q, k: False
cfg0, params0, _ = load_for_bench(path, progress=False)
res = {}
for L in (4, 8, 32):
    cfg = dataclasses.replace(cfg0, n_layers=L, layer_windows=cfg0.layer_windows[:L],
                              layer_rope_theta=cfg0.layer_rope_theta[:L], layer_rope_linear=cfg0.layer_rope_linear[:L])
    params = dataclasses.replace(params0, layers=params0.layers[:L])
    B = 1
    cache = init_cache(cfg, B, 1024, jnp.bfloat16)
    tokens = jnp.zeros((B, 512), jnp.int32); lengths = jnp.full((B,), 500, jnp.int32)
    sp = SamplingParams.make(B); key = jax.random.key(0)
    t0 = time.perf_counter(); lo = engine.prefill_and_sample.trace(cfg, params, cache, tokens, lengths, None, key, sp).lower()
    t1 = time.perf_counter(); lo.compile(); t2 = time.perf_counter()
    state = engine.initial_state(jnp.zeros((B,), jnp.int32), 64, jnp.asarray([-1]), key, cache)
    lo2 = engine.decode_loop.trace(cfg, params, cache, state, sp, jnp.asarray([-1]), 16).lower()
    t3 = time.perf_counter(); lo2.compile(); t4 = time.perf_counter()
    res[L] = dict(prefill_lower=t1 - t0, prefill_compile=t2 - t1, decode_lower=t3 - t2, decode_compile=t4 - t3)
    print(f"[{tag}] L={L} " + " ".join(f"{k}={v:.2f}" for k, v in res[L].items()), flush=True)
json.dump(res, open(out, "w"), indent=1)
