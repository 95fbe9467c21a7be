"""End-to-end decode tokens/s with the decode attention split over more programs: the least
number of key blocks per split (4 today) set to 4, 2, 1, in one process per model."""
import sys, json
import jax
import pallas_kernels.attention.decode as D
from rjax.bench import BenchSettings, load_for_bench, run_bench

path, batches, out = sys.argv[1], tuple(int(b) for b in sys.argv[2].split(",")), sys.argv[3]
cfg, params, _ = load_for_bench(path, progress=False)
orig = D.default_num_splits

def policy(min_blocks):
    def f(batch, kv_heads, num_keys, block_k):
        want = -(-2 * D.NUM_SMS_H100 // (batch * kv_heads))
        return max(1, min(want, num_keys // (min_blocks * block_k)))
    return f

res = []
for mb in [int(x) for x in sys.argv[4].split(",")]:
    D.default_num_splits = policy(mb)
    jax.clear_caches()
    r = run_bench((cfg, params), BenchSettings(prompt_len=512, gen=128, batches=batches, steps_per_dispatch=(16,),
                                               repeats=3, copy_bytes=1 << 28), progress=False)
    tg = {b: round(v["tokens_per_s"], 1) for b, v in r["summary"]["decode_by_batch"].items()}
    splits = {b: policy(mb)(int(b), cfg.n_kv_heads, r["settings"]["cache_len"], 128) for b in tg}
    print(f"{path.split('/')[-1]} min_blocks={mb} splits={splits} tokens/s={tg} errors={r['errors']}", flush=True)
    res.append(dict(min_blocks=mb, splits=splits, tokens_per_s=tg))
json.dump(res, open(out, "w"), indent=1)
