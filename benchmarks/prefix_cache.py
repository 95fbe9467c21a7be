"""Prefix caching and chunked prefill through the serving engine.

    python benchmarks/prefix_cache.py --out "$OUT/prefix_cache.json"          # H100, llama-8b Q4_K
    python benchmarks/prefix_cache.py --smoke --out /tmp/prefix_cache.json    # tiny shapes, CPU

1. Shared system prompt. --requests requests (64), each a --system-token system prompt (2,048)
   shared by all plus its own --question-token question (64), --gen new tokens each, submitted
   at once to one ServingEngine with 64 slots. Peer: the same engine with the prefix cache off,
   in the same run. Reported: mean and p50 time to first token, the whole batch's wall time,
   and the ratios (target: mean TTFT at least 5x lower with the cache, throughput 2x higher).
2. A long prompt between running streams. --streams streams (8) decode; then one prompt of
   --long tokens (32,000) arrives and is prefilled in chunks of the engine's chunk_tokens,
   one chunk per step between the streams' decode dispatches. Reported: the streams' inter-
   token latency before the long prompt and while it is prefilled (each step's wall time over
   the tokens a stream got in it), and the long prompt's time to first token.

Programs are compiled before anything is timed (`ServingEngine.precompile` with the prompt
lengths the scenario forms), and each arm runs once untimed first on a few requests.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rjax.cli.bench_report import write_json  # noqa: E402
from rjax.loading.loaders import for_backend  # noqa: E402
from rjax.loading.loaders.gguf import load_gguf  # noqa: E402
from rjax.loading.synth import write_synthetic  # noqa: E402
from rjax.runtime.serving import ServingConfig, ServingEngine  # noqa: E402


def say(msg: str) -> None:
    print(f"[prefix_cache {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def shared_system_prompt(cfg, params, a, dtype) -> dict:
    rng = np.random.default_rng(0)
    system = list(rng.integers(0, cfg.vocab_size, a.system))
    prompts = [system + list(rng.integers(0, cfg.vocab_size, a.question)) for _ in range(a.requests)]
    max_len = _round_up(a.system + a.question + a.gen, a.page_size)
    out = {}
    for on in (False, True):
        config = ServingConfig(n_slots=a.requests, max_len=max_len, page_size=a.page_size, steps_per_dispatch=a.steps,
                               max_prefill_tokens=a.prefill_tokens, kv_dtype=jnp.dtype(dtype).name, prefix_cache=on)
        eng = ServingEngine(cfg, params, config)
        t0 = time.perf_counter()
        eng.precompile(prompt_lengths=[a.system + a.question, a.question])
        compile_s = time.perf_counter() - t0
        # Untimed: other prompts through every path once (the cache then holds nothing of ours).
        warm = [list(rng.integers(0, cfg.vocab_size, a.system + a.question)) for _ in range(2)]
        for p in warm + [warm[0][: a.system] + list(rng.integers(0, cfg.vocab_size, a.question))]:
            eng.submit(p, max_new_tokens=a.steps + 1)
        for _ in eng.run():
            pass
        if on:
            eng.pages.clear_cache()
            before = dict(vars(eng.prefix_stats))
        t0 = time.perf_counter()
        for p in prompts:
            eng.submit(p, max_new_tokens=a.gen)
        ttft, generated = [], 0
        for e in eng.run():
            generated += len(e.tokens)
            if e.finished:
                ttft.append(e.completion.ttft_s)
        wall = time.perf_counter() - t0
        arm = dict(wall_s=wall, ttft_mean_s=float(np.mean(ttft)), ttft_p50_s=float(np.median(ttft)),
                   ttft_max_s=float(np.max(ttft)), requests_per_s=a.requests / wall,
                   tokens_per_s=(a.requests * (a.system + a.question) + generated) / wall,
                   generated_tokens=generated, compile_s=compile_s)
        if on:
            arm["prefix_stats"] = {k: v - before[k] for k, v in vars(eng.prefix_stats).items()}
        out["on" if on else "off"] = arm
        say(f"cache {'on ' if on else 'off'}: wall {wall:.2f}s, TTFT mean {arm['ttft_mean_s'] * 1e3:.0f} ms "
            f"(p50 {arm['ttft_p50_s'] * 1e3:.0f}), {arm['requests_per_s']:.1f} requests/s")
        del eng
    out["ttft_mean_speedup"] = out["off"]["ttft_mean_s"] / out["on"]["ttft_mean_s"]
    out["throughput_speedup"] = out["off"]["wall_s"] / out["on"]["wall_s"]
    return out


def long_prompt_between_streams(cfg, params, a, dtype) -> dict:
    rng = np.random.default_rng(1)
    stream_gen = a.stream_gen
    max_len = _round_up(a.long + a.gen, a.page_size)
    stream_pages = (a.streams + 1) * _round_up(32 + stream_gen, a.page_size) // a.page_size
    config = ServingConfig(n_slots=a.streams + 1, max_len=max_len, page_size=a.page_size,
                           n_pages=max_len // a.page_size + stream_pages, steps_per_dispatch=a.steps,
                           max_prefill_tokens=a.prefill_tokens, kv_dtype=jnp.dtype(dtype).name, prefix_cache=False)
    eng = ServingEngine(cfg, params, config)
    t0 = time.perf_counter()
    eng.precompile(prompt_lengths=[a.long, 32])
    compile_s = time.perf_counter() - t0
    for _ in range(2):   # untimed: every program once
        eng.submit(list(rng.integers(0, cfg.vocab_size, 32)), max_new_tokens=a.steps + 1)
    for _ in eng.run():
        pass
    streams = [eng.submit(list(rng.integers(0, cfg.vocab_size, 32)), max_new_tokens=stream_gen)
               for _ in range(a.streams)]
    before, during, long_id, t_long, long_ttft = [], [], None, 0.0, None
    steps = 0
    while eng.has_work:
        t0 = time.perf_counter()
        events = eng.step()
        dt = time.perf_counter() - t0
        steps += 1
        got = [len(e.tokens) for e in events if e.request_id in streams and e.tokens]
        per_token = [dt / n for n in got]
        if long_id is None:
            if steps > 2:
                before += per_token
            if steps == 6:
                long_id = eng.submit(list(rng.integers(0, cfg.vocab_size, a.long)), max_new_tokens=a.gen)
                t_long = time.perf_counter()
        elif long_ttft is None:
            during += per_token
            if any(e.request_id == long_id and e.tokens for e in events):
                long_ttft = time.perf_counter() - t_long
        if long_ttft is not None and not any(e.request_id in streams and not e.finished for e in events):
            break
    out = dict(long_tokens=a.long, chunk_tokens=config.chunk_tokens, streams=a.streams, compile_s=compile_s,
               itl_before_ms=float(np.mean(before) * 1e3) if before else None,
               itl_during_ms=float(np.mean(during) * 1e3) if during else None,
               itl_during_max_ms=float(np.max(during) * 1e3) if during else None,
               stream_tokens_during=len(during), long_ttft_s=long_ttft)
    say(f"long prompt {a.long} tokens in chunks of {config.chunk_tokens}: TTFT {long_ttft}s; streams' ITL "
        f"{out['itl_before_ms']} ms before, {out['itl_during_ms']} ms during (max {out['itl_during_max_ms']})")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--workdir", default="/tmp/rjax-prefix-bench")
    p.add_argument("--shape", default="llama-8b")
    p.add_argument("--quant", default="q4_k")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system", type=int, default=2048)
    p.add_argument("--question", type=int, default=64)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-gen", type=int, default=512)
    p.add_argument("--long", type=int, default=32000)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=8, help="decode steps per dispatch")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="ServingConfig.max_prefill_tokens")
    p.add_argument("--only", choices=("shared", "long"), default=None)
    p.add_argument("--smoke", action="store_true", help="2 layers, small vocabulary and lengths (CPU)")
    a = p.parse_args(argv)
    synth_kw = {}
    if a.smoke:
        synth_kw = dict(n_layers=2, vocab_size=512)
        a.requests, a.system, a.question, a.gen, a.long, a.stream_gen = 8, 64, 8, 4, 300, 64
        a.prefill_tokens, a.steps = 128, 4
    path = Path(a.workdir) / f"{a.shape}-{a.quant}{'-smoke' if a.smoke else ''}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    result = dict(device=str(jax.devices()[0]), shape=a.shape, quant=a.quant, args=vars(a))
    if not path.exists():
        t0 = time.perf_counter()
        say(f"writing {path}")
        write_synthetic(path, a.shape, a.quant, seed=0, tokenizer_from="builtin", **synth_kw)
        result["synth_s"] = time.perf_counter() - t0
    cfg, params, _ = load_gguf(path, progress=False)
    params = for_backend(params)
    jax.block_until_ready(params)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if a.only in (None, "shared"):
        result["shared_system_prompt"] = shared_system_prompt(cfg, params, a, dtype)
        write_json(result, a.out)
    if a.only in (None, "long"):
        result["long_prompt"] = long_prompt_between_streams(cfg, params, a, dtype)
        write_json(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
