"""Host trace of XLA compiling prefill_and_sample and decode_loop (4 layers of the model): which passes take the time."""
import dataclasses, sys, time, glob, collections, re
import jax, jax.numpy as jnp
from jax._src.profiler import ProfileData
from rjax.bench import load_for_bench
from rjax import engine
from rjax.cache import init_cache
from rjax.sampling import SamplingParams

path, L = sys.argv[1], int(sys.argv[2])
cfg0, params0, _ = load_for_bench(path, progress=False)
cfg = dataclasses.replace(cfg0, n_layers=L, layer_windows=cfg0.layer_windows[:L],
                          layer_rope_theta=cfg0.layer_rope_theta[:L], layer_rope_linear=cfg0.layer_rope_linear[:L])
params = dataclasses.replace(params0, layers=params0.layers[:L])
B = 1
cache = init_cache(cfg, B, 1024, jnp.bfloat16)
tokens = jnp.zeros((B, 512), jnp.int32); lengths = jnp.full((B,), 500, jnp.int32)
sp = SamplingParams.make(B); key = jax.random.key(0)
state = engine.initial_state(jnp.zeros((B,), jnp.int32), 64, jnp.asarray([-1]), key, cache)
for name, lo in [("prefill", engine.prefill_and_sample.trace(cfg, params, cache, tokens, lengths, None, key, sp).lower()),
                 ("decode", engine.decode_loop.trace(cfg, params, cache, state, sp, jnp.asarray([-1]), 16).lower())]:
    d = f"/tmp/tr-{name}"
    jax.profiler.start_trace(d)
    t0 = time.perf_counter(); lo.compile(); dt = time.perf_counter() - t0
    jax.profiler.stop_trace()
    pd = ProfileData.from_file(sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1])
    tot, cnt = collections.Counter(), collections.Counter()
    for plane in pd.planes:
        for line in plane.lines:
            for ev in line.events:
                if ev.name.startswith("$"):
                    continue
                k = re.sub(r"\d+", "#", ev.name)[:110]
                tot[k] += ev.duration_ns; cnt[k] += 1
    print(f"== {name} L={L}: compile {dt:.2f} s")
    for k, v in tot.most_common(40):
        print(f"  {v/1e9:8.3f} s  x{cnt[k]:<5d} {k}")
