"""Where the compile time of prefill_and_sample / decode_loop goes: trace, lower, XLA compile."""
import sys, time, re, json
import jax, jax.numpy as jnp, numpy as np
from rjax.bench import load_for_bench
from rjax import engine
from rjax.cache import init_cache
from rjax.sampling import SamplingParams

path, tag = sys.argv[1], sys.argv[2]
t = time.perf_counter()
cfg, params, _ = load_for_bench(path, progress=False)
print(f"[{tag}] load {time.perf_counter()-t:.1f}s layers={cfg.n_layers}", flush=True)
res = {}
for B in (1,):
    cache = init_cache(cfg, B, 1024, jnp.bfloat16)
    tokens = jnp.zeros((B, 512), jnp.int32); lengths = jnp.full((B,), 500, jnp.int32)
    sp = SamplingParams.make(B); key = jax.random.key(0)
    for name, fn, args in [
        ("prefill", engine.prefill_and_sample, (cfg, params, cache, tokens, lengths, None, key, sp)),
    ]:
        t0 = time.perf_counter(); tr = fn.trace(*args); t1 = time.perf_counter()
        lo = tr.lower(); t2 = time.perf_counter()
        txt = lo.as_text()
        co = lo.compile(); t3 = time.perf_counter()
        n_tri = txt.count("__gpu$xla.gpu.triton"); n_cc = txt.count("stablehlo.custom_call")
        kern = set(re.findall(r'name = "([^"]+)"', txt))
        r = dict(trace=t1-t0, lower=t2-t1, compile=t3-t2, triton_calls=n_tri, custom_calls=n_cc, hlo_chars=len(txt))
        res[f"{name} B={B}"] = r
        print(f"[{tag}] {name} B={B}: " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    state = engine.initial_state(jnp.zeros((B,), jnp.int32), 64, jnp.asarray([-1]), key, cache)
    t0 = time.perf_counter(); tr = engine.decode_loop.trace(cfg, params, cache, state, sp, jnp.asarray([-1]), 16); t1 = time.perf_counter()
    lo = tr.lower(); t2 = time.perf_counter(); txt = lo.as_text(); co = lo.compile(); t3 = time.perf_counter()
    r = dict(trace=t1-t0, lower=t2-t1, compile=t3-t2, triton_calls=txt.count("__gpu$xla.gpu.triton"), hlo_chars=len(txt))
    res[f"decode B={B}"] = r
    print(f"[{tag}] decode B={B}: " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
json.dump(res, open(sys.argv[3], "w"), indent=1)
