"""The 9 programs of `rjax bench --batch 1,8,32 --steps-per-dispatch 16,1` compiled one after another, or concurrently in threads."""
import sys, time, json
from concurrent.futures import ThreadPoolExecutor
import jax, jax.numpy as jnp
from rjax.bench import load_for_bench
from rjax import engine
from rjax.cache import init_cache
from rjax.sampling import SamplingParams

path, workers, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg, params, _ = load_for_bench(path, progress=False)
key = jax.random.key(0)
lowered = {}
t0 = time.perf_counter()
for B in (1, 8, 32):
    cache = init_cache(cfg, B, 656, jnp.bfloat16)
    tokens = jnp.zeros((B, 512), jnp.int32); lengths = jnp.full((B,), 512, jnp.int32)
    sp = SamplingParams.make(B)
    lowered[f"prefill B={B}"] = engine.prefill_and_sample.trace(cfg, params, cache, tokens, lengths, None, key, sp).lower()
    state = engine.initial_state(jnp.zeros((B,), jnp.int32), 64, jnp.asarray([-1]), key, cache)
    for n in (16, 1):
        lowered[f"decode B={B} N={n}"] = engine.decode_loop.trace(cfg, params, cache, state, sp, jnp.asarray([-1]), n).lower()
t_lower = time.perf_counter() - t0
print(f"lowered {len(lowered)} programs in {t_lower:.1f} s", flush=True)

def compile_one(item):
    name, lo = item
    t = time.perf_counter(); lo.compile(); return name, time.perf_counter() - t

t0 = time.perf_counter()
if workers <= 1:
    times = dict(map(compile_one, lowered.items()))
else:
    with ThreadPoolExecutor(workers) as ex:
        times = dict(ex.map(compile_one, lowered.items()))
wall = time.perf_counter() - t0
print(f"workers={workers}: compile wall {wall:.1f} s, sum {sum(times.values()):.1f} s; " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()), flush=True)
json.dump(dict(workers=workers, lower_s=t_lower, compile_wall_s=wall, per_program_s=times), open(out, "w"), indent=1)
