"""Runs in its own process with 8 forced host devices (tests/math/test_tensor_parallel.py starts it):
a model on one device and split over 2, 4 and 8, the same prompts through each.

    python tests/tp_worker.py MODEL OUT.npz [--tp 2,4,8] [--steps N] [--fuse] [--logits-only] [--draft-tp N] [--gpu]

Writes, per run ("1" and each tp): the prefill and decode logits [steps + 1, B, vocab], the
greedy tokens, rjax.generate's greedy ids, the serving engine's (with --draft-tp also those of
speculative serving at that split, drafted by the unsplit model), and the fullest device's bytes of params
next to the whole model's.
"""
from __future__ import annotations

import os
import sys

if "--gpu" not in sys.argv:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import rjax  # noqa: E402
from rjax.engine import steps as engine  # noqa: E402
from rjax.math import tensor_parallel
from rjax.math.cache import init_cache  # noqa: E402
from rjax.runtime.generation import stream_ids  # noqa: E402

PROMPTS = [[1, 5, 9, 14, 3, 27, 8], [11, 4, 30], [2, 40, 7, 7, 19, 33, 12, 6, 21, 9, 17]]


def _padded(rows) -> np.ndarray:
    out = np.full((len(rows), max(len(r) for r in rows)), -1)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _serve(cfg, params, steps: int, **kw) -> np.ndarray:
    """The serving engine's greedy tokens for PROMPTS (2 slots, paged)."""
    eng = rjax.ServingEngine(cfg, params, rjax.ServingConfig(n_slots=2, max_len=64, page_size=8, steps_per_dispatch=4,
                                                             prefill_buckets=(2,), **kw.pop("config", {})), **kw)
    ids = [eng.submit(p, max_new_tokens=steps) for p in PROMPTS]
    done = {e.request_id: e.completion.tokens for e in eng.run() if e.finished}
    return _padded([done[i] for i in ids])


def run(model, steps: int, engines: bool = True, draft=None) -> dict:
    cfg, params = model.config, model.params
    cache = tensor_parallel.place_cache(init_cache(cfg, len(PROMPTS), 64), params.tp)
    tokens, lengths = engine.pad_prompts(PROMPTS)
    logits, cache = engine.prefill(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths))
    out, greedy = [np.asarray(logits)], [np.asarray(jnp.argmax(logits, -1))]
    for _ in range(steps):
        logits, cache = engine.decode_step(cfg, params, cache, jnp.asarray(greedy[-1], jnp.int32))
        out.append(np.asarray(logits))
        greedy.append(np.asarray(jnp.argmax(logits, -1)))
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    out = dict(logits=np.stack(out), greedy=np.stack(greedy, 1),
               bytes=np.array([tensor_parallel.per_device_bytes(params), total]))
    if not engines:
        return out
    gen = [[] for _ in PROMPTS]
    for new in stream_ids(model, PROMPTS, max_new_tokens=steps):
        for g, t in zip(gen, new):
            g.extend(t)
    out = dict(out, generate=_padded(gen), serving=_serve(cfg, params, steps))
    if draft is not None:  # speculative serving, a draft model (on one device) beside the split target
        out["speculative"] = _serve(cfg, params, steps, config=dict(speculative="model", draft_tokens=3),
                                    draft=(draft.config, draft.params))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--tp", default="2,4,8")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--fuse", action="store_true", help="stack q/k/v and gate/up first, as on a GPU")
    p.add_argument("--logits-only", action="store_true", help="skip rjax.generate and the serving engine")
    p.add_argument("--gpu", action="store_true", help="on the machine's GPUs (default: 8 forced CPU devices)")
    p.add_argument("--draft-tp", type=int, default=0,
                   help="at this split, also serve with the model itself (on one device) as draft model")
    a = p.parse_args(argv)
    results = {}
    kw = dict(progress=False, fuse=a.fuse or None)
    draft = rjax.load(a.model, **kw) if a.draft_tp else None
    for n in [1] + [int(t) for t in a.tp.split(",")]:
        model = rjax.load(a.model, **kw) if n == 1 else rjax.load(a.model, mesh=tensor_parallel.make_tp(n).mesh, **kw)
        for k, v in run(model, a.steps, not a.logits_only, draft if n == a.draft_tp else None).items():
            results[f"{n}/{k}"] = v
        print(f"tp={n}: {model.config.n_heads} q / {model.config.n_kv_heads} KV heads", file=sys.stderr, flush=True)
    np.savez(a.out, **results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
