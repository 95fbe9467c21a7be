"""Decode tokens/s of a model split over several GPUs (rjax.math.tensor_parallel), beside the HBM
roofline of the devices it runs on.

    python benchmarks/tensor_parallel.py --gguf /tmp/l8b.gguf --tp 1,2 --batch 1,32 --out "$OUT/tp8b.json"
    python benchmarks/tensor_parallel.py --shape llama-70b --tp 2 --batch 1 --out "$OUT/tp70b.json"

--gguf: a GGUF file loaded with `rjax.load(..., mesh=)` at each --tp. --shape llama-70b: a
Llama-3-70B-shaped model in F16 with random weights made on the devices in their shards (about
141 GB: no file, and no device ever holds the whole model). Each (tp, batch): a 128-token
random prompt per sequence, then `engine.greedy_decode_loop` dispatches of --steps tokens, timed after
a warm-up. The roofline: each device streams its share of the weights once per step (plus its
share of the KV cache) at the fastest device-to-device copy rate measured on it in this run,
so batch-1 tokens/s can be at most copy rate / per-device bytes per step.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rjax.engine import steps as engine  # noqa: E402
from rjax.engine.roofline import measure_bandwidth  # noqa: E402
from rjax.math import tensor_parallel as tpl
from rjax.math.cache import init_cache  # noqa: E402
from rjax.math.config import ModelConfig  # noqa: E402
from rjax.math.model import LayerParams, Params  # noqa: E402
from rjax.math.sampling import SamplingParams  # noqa: E402
from rjax.runtime.generation import activation_dtype  # noqa: E402

LLAMA_70B = ModelConfig(arch="llama", n_layers=80, d_model=8192, d_ff=28672, n_heads=64, n_kv_heads=8, head_dim=128,
                        vocab_size=128256, context_length=131072, rms_eps=1e-5, rope_theta=500000.0,
                        rope_pairing="pairs", tie_embeddings=False)


def say(msg: str) -> None:
    print(f"[tp {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def random_split_params(cfg: ModelConfig, tp: tpl.TensorParallel, dtype=jnp.float16) -> Params:
    """F16 weights of cfg's shapes (fused q/k/v and gate/up, as on a GPU), each made on the
    devices in its own shards by a jitted random draw: RMS 1/sqrt(row length), norms 1."""
    D, H, K, F = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_ff
    key = iter(jax.random.split(jax.random.key(0), 8 * cfg.n_layers + 8))

    def make(shape, spec):
        sharding = tp.sharding(spec)
        scale = 1.0 / np.sqrt(shape[-1])
        return jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype),
                       out_shardings=sharding)(next(key))

    def ones(n):
        return jax.device_put(jnp.ones((n,), jnp.float32), tp.sharding(tpl.P()))

    row, col = tpl.P(tp.axis, None), tpl.P(None, tp.axis)
    layers = []
    for i in range(cfg.n_layers):
        layers.append(LayerParams(attn_norm=ones(D), wq=None, wk=None, wv=None, wo=make((D, H), col),
                                  ffn_norm=ones(D), w_gate=None, w_up=None, w_down=make((D, F), col),
                                  wqkv=make((H + 2 * K, D), row), w_gate_up=make((2 * F, D), row)))
        if i % 10 == 9:
            say(f"  {i + 1} of {cfg.n_layers} layers made")
    return Params(embed=make((cfg.vocab_size, D), tpl.P()), layers=tuple(layers), final_norm=ones(D),
                  lm_head=make((cfg.vocab_size, D), row), tp=tp)


def decode_rate(cfg, params, batch: int, steps: int, repeats: int, prompt: int = 128) -> dict:
    dtype = activation_dtype()
    S = prompt + steps * (repeats + 2) + 8  # room for the warm-up and timed dispatches
    cache = tpl.place_cache(init_cache(cfg, batch, S, dtype), params.tp)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt)), jnp.int32)
    lengths = jnp.full((batch,), prompt, jnp.int32)
    sp = SamplingParams.make(batch)
    stop = jnp.asarray([-1], jnp.int32)
    t0 = time.perf_counter()
    first, cache = engine.prefill_and_sample(cfg, params, cache, tokens, lengths, None, jax.random.key(1), sp)
    jax.block_until_ready(first)
    prefill_s = time.perf_counter() - t0
    state = engine.initial_state(first, jnp.full((batch,), 1 << 30, jnp.int32), stop, jax.random.key(2), cache)
    for _ in range(2):  # compiles (the second call: for the shardings the first one's outputs have)
        out, state, cache = engine.greedy_decode_loop(cfg, params, cache, state, sp, stop, steps)
        jax.block_until_ready(out)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, state, cache = engine.greedy_decode_loop(cfg, params, cache, state, sp, stop, steps)
        jax.block_until_ready(out)
        rates.append(batch * steps / (time.perf_counter() - t0))
    return dict(batch=batch, prefill_s_with_compile=prefill_s, tokens_per_s=float(np.median(rates)),
                runs=[float(r) for r in rates], kv_len=int(S))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help="a GGUF model file")
    p.add_argument("--shape", choices=("llama-70b",), help="a random F16 model of this shape, made on the devices")
    p.add_argument("--tp", default="1,2")
    p.add_argument("--batch", default="1,32")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if (a.gguf is None) == (a.shape is None):
        p.error("give one of --gguf and --shape")
    devices = jax.devices()
    say(f"{len(devices)} devices: {devices[0].device_kind}")
    bw = measure_bandwidth()  # on the first device; the others are the same part
    copy = bw["gb_per_s"] * 1e9
    say(f"bandwidth per device: {bw['gb_per_s']:.0f} GB/s by {bw['probe']}")
    result = dict(devices=[d.device_kind for d in devices], bandwidth=bw, runs=[])
    for n in (int(t) for t in a.tp.split(",")):
        tp = tpl.make_tp(n) if n > 1 else None
        t0 = time.perf_counter()
        if a.gguf:
            import rjax

            m = rjax.load(a.gguf, mesh=None if tp is None else tp.mesh, progress=False)
            cfg, params = m.config, m.params
        else:
            tp = tp or tpl.make_tp(1)
            cfg, params = tpl.split_config(LLAMA_70B, n), random_split_params(tpl.split_config(LLAMA_70B, n), tp)
        jax.block_until_ready(params)
        load_s = time.perf_counter() - t0
        total = sum(x.nbytes for x in jax.tree.leaves(params))
        per_device = tpl.per_device_bytes(params)
        say(f"tp={n}: {total / 1e9:.1f} GB of params, {per_device / 1e9:.1f} GB on the fullest device "
            f"(loaded in {load_s:.0f} s)")
        for b in (int(t) for t in a.batch.split(",")):
            r = decode_rate(cfg, params, b, a.steps, a.repeats)
            ceiling = copy / per_device  # steps/s if each device streamed only its weights
            r.update(tp=n, params_gb=total / 1e9, per_device_gb=per_device / 1e9,
                     roofline_tokens_per_s=b * ceiling, fraction_of_roofline=r["tokens_per_s"] / (b * ceiling))
            result["runs"].append(r)
            say(f"tp={n} batch {b}: {r['tokens_per_s']:.1f} tokens/s (weights roofline {b * ceiling:.1f}: "
                f"{100 * r['fraction_of_roofline']:.0f}%)")
            Path(a.out).write_text(json.dumps(result, indent=1))
        del params
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
