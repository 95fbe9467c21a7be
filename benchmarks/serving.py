"""Serving throughput: aggregate decode tokens/s against the number of running sequences.

Peer: the same engine's batch-1 rate, measured in the same run (each row's speed-up over it).
No external engine runs here; llama.cpp's batched-decode figure for llama-8b is in e2e.py.

    python benchmarks/serving.py --out "$OUT/serving.json"             # H100, about 4 minutes
    python benchmarks/serving.py --smoke --out /tmp/serving.json       # tiny shapes, CPU, a minute

For each synthetic model (llama-1b and llama-8b shapes, q4_k; written under --workdir unless
already there) and each batch size B: a paged cache of B slots, each already holding --context
positions in its own pages, and the program `ServingEngine.step` runs for decoding
(`rjax.engine.slots.decode_dispatch` over the paged cache: a random stream, sampling parameters and
stop ids per slot, --steps decode steps per dispatch, every slot active; every slot greedy, so
the engine's program without sampling, or with --temperature T every slot sampling at T, with
--top-p P < 1 through the filters' search, as the engine's programs for such requests do).
The first dispatch is a warm-up; --dispatches timed ones follow, each synced by fetching its
tokens. tokens/s = B x steps / the median dispatch's time.

Every program is compiled first, all batch sizes in parallel threads, so the compile time is
paid once per model; the persistent compilation cache under --workdir makes a second run of
the script start faster. A batch size whose cache does not fit the free device memory
(`rjax.engine.memory.plan_memory`) is skipped with the reason. Each model gets a share of --budget;
batch sizes still unmeasured when its share is spent are listed as skipped. With --serve-requests,
the first model also runs that many requests end to end through `ServingEngine` (multi-prompt
prefill, admission into 64 slots, streaming) when time remains.

The JSON (--out) is rewritten after every measurement; a table is printed at the end. Target:
at 64 slots, llama-1b decodes at least 20x the batch-1 rate.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rjax.cli.bench_report import write_json  # noqa: E402
from rjax.engine import steps as engine  # noqa: E402
from rjax.engine.memory import MemoryFitError, kv_bytes_per_position, plan_memory, tree_bytes  # noqa: E402
from rjax.engine.precompile import Program, compile_programs  # noqa: E402
from rjax.engine.slots import decode_dispatch, init_slots  # noqa: E402
from rjax.engine.steps import DecodeState  # noqa: E402
from rjax.math.paged_cache import PagedKVCache  # noqa: E402
from rjax.math.sampling import SamplingParams  # noqa: E402
from rjax.runtime.serving import ServingConfig, ServingEngine  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# (shape, quantization mix, share of the time budget); batch sizes are measured in this order
# (the ones the target needs first), reported in increasing order.
MODELS = (("llama-1b", "q4_k", 0.4), ("llama-8b", "q4_k", 0.6))
ORDER = (1, 64, 256, 32, 128, 8, 16, 4, 2)
TARGET = ("llama-1b", 64, 20.0)  # (shape, slots, minimum speed-up over batch 1)
MAX_STOP_IDS = 8


def say(msg: str) -> None:
    print(f"[serving {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def decode_inputs(cfg, B: int, context: int, max_len: int, page_size: int, dtype, abstract: bool,
                  temperature: float = 0.0, top_p: float = 1.0):
    """(cache, slots) for B slots each holding `context` positions on its own pages (slot b owns
    pages b * max_pages ...), every slot active, greedy and never stopping."""
    max_pages = max_len // page_size
    pool = (cfg.n_layers, B * max_pages, cfg.n_kv_heads, page_size, cfg.head_dim)
    if abstract:
        arr = jax.ShapeDtypeStruct
        kv = arr(pool, dtype)
        cache = PagedKVCache(kv, kv, arr((B, max_pages), jnp.int32), arr((B,), jnp.int32),
                             arrivals=arr((B, cfg.n_kv_heads), jnp.int32))
        return cache, jax.eval_shape(lambda: init_slots(B, MAX_STOP_IDS, cfg.vocab_size))
    # As init_paged_cache makes it: the fused decode kernel's split counts kept zero in the cache.
    cache = PagedKVCache(jnp.zeros(pool, dtype), jnp.zeros(pool, dtype),
                         jnp.arange(B * max_pages, dtype=jnp.int32).reshape(B, max_pages),
                         jnp.full((B,), context, jnp.int32), arrivals=jnp.zeros((B, cfg.n_kv_heads), jnp.int32))
    rng = np.random.default_rng(B)
    state = DecodeState(jnp.asarray(rng.integers(0, cfg.vocab_size, B), jnp.int32), jnp.zeros((B,), bool),
                        jnp.full((B,), max_len, jnp.int32), jax.random.split(jax.random.key(B), B))
    return cache, dataclasses.replace(init_slots(B, MAX_STOP_IDS, cfg.vocab_size), state=state,
                                      sampling=SamplingParams.make(B, temperature, top_p=top_p))


def compile_all(cfg, params, batches, a, max_len, dtype, workers):
    """{B: (compiled decode dispatch, seconds lowering + compiling it) or an error string}: one
    `rjax.engine.precompile.compile_programs` call, the compilations in parallel threads."""
    programs = [Program(f"B={B}", decode_dispatch,
                        (cfg, params, *decode_inputs(cfg, B, a.context, max_len, a.page_size, dtype, abstract=True),
                         a.steps, False, None, a.temperature == 0, a.top_p < 1)) for B in batches]
    report = compile_programs(programs, workers, on_error="record")
    out = {}
    for B in batches:
        name = f"B={B}"
        out[B] = report.errors[name][:400] if name in report.errors else \
            (report.compiled[name], report.lowered_s[name] + report.compile_s[name])
    return out


def measure(compiled, cfg, params, B, a, max_len, dtype) -> dict:
    cache, slots = decode_inputs(cfg, B, a.context, max_len, a.page_size, dtype, abstract=False,
                                 temperature=a.temperature, top_p=a.top_p)
    jax.block_until_ready((cache, slots))
    t0 = time.perf_counter()
    out, _, slots, cache = compiled(params, cache, slots, None)
    np.asarray(out)
    warmup_s = time.perf_counter() - t0
    times, tokens = [], 0
    for _ in range(a.dispatches):
        t0 = time.perf_counter()
        out, _, slots, cache = compiled(params, cache, slots, None)
        out = np.asarray(out)
        times.append(time.perf_counter() - t0)
        tokens += int((out >= 0).sum())
    expected = B * a.steps * a.dispatches
    if tokens != expected:
        raise RuntimeError(f"B={B}: {tokens} tokens generated, expected {expected}: a slot stopped early")
    del cache, slots
    total, median = sum(times), float(np.median(times))
    # The median dispatch: one host stall (a 61 against 17 ms dispatch was seen) would move a mean.
    return dict(tokens=tokens, time_s=total, tokens_per_s=B * a.steps / median,
                step_ms=1e3 * median / a.steps, dispatch_s=times, warmup_s=warmup_s)


def serve_end_to_end(cfg, params, a, dtype, deadline) -> dict:
    """--serve-requests requests (random prompts of --serve-prompt tokens, --serve-gen new tokens each)
    through a 64-slot ServingEngine."""
    page = a.page_size
    max_len = -(-(a.serve_prompt + a.serve_gen) // page) * page
    config = ServingConfig(n_slots=64, max_len=max_len, page_size=page, steps_per_dispatch=a.steps,
                           prefill_buckets=(16,), max_prefill_tokens=16 * engine.prompt_bucket(a.serve_prompt),
                           kv_dtype=jnp.dtype(dtype).name)
    rng = np.random.default_rng(0)
    eng = ServingEngine(cfg, params, config)
    compiled = eng.precompile(prompt_lengths=[a.serve_prompt])  # the decode and prefill programs
    # Warm-up: a few requests through every step once (the small bookkeeping programs compile).
    t0 = time.perf_counter()
    for _ in range(16):
        eng.submit(rng.integers(0, cfg.vocab_size, a.serve_prompt),
                   max_new_tokens=min(2 * a.steps, max_len - a.serve_prompt))
    for _ in eng.run():
        pass
    warmup_s = time.perf_counter() - t0
    if time.perf_counter() > deadline:
        return dict(skipped="no time left after the warm-up", compile_s=compiled.total_s, warmup_s=warmup_s)
    for _ in range(a.serve_requests):
        eng.submit(rng.integers(0, cfg.vocab_size, a.serve_prompt), max_new_tokens=a.serve_gen)
    t0 = time.perf_counter()
    generated, ttft = 0, []
    for e in eng.run():
        generated += len(e.tokens)
        if e.finished:
            ttft.append(e.completion.ttft_s)
    wall = time.perf_counter() - t0
    return dict(requests=a.serve_requests, prompt=a.serve_prompt, gen=a.serve_gen, slots=64, wall_s=wall,
                generated_tokens=generated, tokens_per_s=generated / wall,
                prompt_tokens_per_s=a.serve_requests * a.serve_prompt / wall,
                ttft_s_p50=float(np.median(ttft)), ttft_s_max=float(np.max(ttft)), compile_s=compiled.total_s,
                warmup_s=warmup_s)


def run_model(shape, quant, batches, a, deadline, result, row, synth_kw) -> None:
    from rjax.loading.loaders import for_backend
    from rjax.loading.loaders.gguf import load_gguf
    from rjax.loading.synth import write_synthetic

    tag = f"{shape}-{quant}" + ("-smoke" if a.smoke else "")
    path = Path(a.workdir) / f"{tag}.gguf"
    if not path.exists():
        t0 = time.perf_counter()
        say(f"writing {path}")
        write_synthetic(path, shape, quant, **synth_kw)
        row["synth_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cfg, params, _ = load_gguf(path, progress=False)
    params = for_backend(params)   # as rjax.load arranges them
    jax.block_until_ready(params)
    row["load_s"] = time.perf_counter() - t0
    row["params_bytes"] = tree_bytes(params)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    max_len = -(-(a.context + a.steps * (a.dispatches + 2)) // a.page_size) * a.page_size
    row.update(context=a.context, max_len=max_len, kv_bytes_per_position=kv_bytes_per_position(cfg, dtype))
    say(f"{tag}: loaded in {row['load_s']:.1f}s ({row['params_bytes'] / 1e9:.2f} GB); {len(batches)} batch sizes")

    fitting = []
    for B in batches:
        try:
            plan_memory(cfg, max_len=max_len, page_size=a.page_size, n_slots=B, n_pages=B * (max_len // a.page_size),
                        prefill_tokens=1, prefill_prompts=1, dtype=dtype, reserve_bytes=a.reserve_mib << 20)
            fitting.append(B)
        except MemoryFitError as e:
            row["batches"][str(B)] = dict(skipped=str(e))
    t0 = time.perf_counter()
    compiled = compile_all(cfg, params, fitting, a, max_len, dtype, a.workers)
    row["compile_wall_s"] = time.perf_counter() - t0
    say(f"{tag}: compiled {len(fitting)} programs in {row['compile_wall_s']:.1f}s")
    write_json(result, a.out)

    for B in sorted(fitting, key=lambda b: ORDER.index(b) if b in ORDER else len(ORDER) + b):
        entry = compiled[B]
        if isinstance(entry, str):
            row["batches"][str(B)] = dict(error=entry)
            continue
        if time.perf_counter() > deadline:
            row["batches"][str(B)] = dict(skipped="time budget spent")
            continue
        try:
            m = measure(entry[0], cfg, params, B, a, max_len, dtype)
            m["compile_s"] = entry[1]
            row["batches"][str(B)] = m
            say(f"{tag}: B={B:4d} {m['tokens_per_s']:10.0f} tok/s  {m['step_ms']:.2f} ms/step")
        except Exception as e:
            row["batches"][str(B)] = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
        compiled[B] = None  # free the executable
        write_json(result, a.out)
    base = row["batches"].get("1", {}).get("tokens_per_s")
    if base:
        for m in row["batches"].values():
            if "tokens_per_s" in m:
                m["speedup_over_b1"] = m["tokens_per_s"] / base
    if a.serve_requests and not row.get("serve") and result["models"][0] is row:
        if time.perf_counter() < deadline - 20:
            try:
                row["serve"] = serve_end_to_end(cfg, params, a, dtype, deadline)
            except Exception as e:
                row["serve"] = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
        else:
            row["serve"] = dict(skipped="time budget spent")
    write_json(result, a.out)


def format_table(result: dict) -> str:
    models = result["models"]
    batches = sorted({int(b) for r in models for b in r["batches"]})
    head = f"{'B':>5}" + "".join(f" {r['model'] + ' tok/s':>22} {'x B=1':>6} {'ms/step':>8}" for r in models)
    lines = [head, "-" * len(head)]
    for B in batches:
        line = f"{B:>5}"
        for r in models:
            m = r["batches"].get(str(B), {})
            if "tokens_per_s" in m:
                line += f" {m['tokens_per_s']:>22,.0f} {m.get('speedup_over_b1', 0):>6.1f} {m['step_ms']:>8.2f}"
            else:
                why = "skipped" if "skipped" in m else "error" if "error" in m else "-"
                line += f" {why:>22} {'':>6} {'':>8}"
        lines.append(line)
    t = result.get("target")
    if t:
        lines.append(f"target: {t['model']} at {t['slots']} slots >= {t['min_speedup']:.0f}x batch 1: "
                     f"{'-' if t['speedup'] is None else format(t['speedup'], '.1f') + 'x'} -> "
                     f"{'met' if t['met'] else 'NOT met'}")
    for r in models:
        s = r.get("serve")
        if s and "tokens_per_s" in s:
            lines.append(f"{r['model']} end to end, {s['requests']} requests x ({s['prompt']} prompt + {s['gen']} new) "
                         f"through {s['slots']} slots: {s['tokens_per_s']:,.0f} generated tok/s, "
                         f"TTFT p50 {s['ttft_s_p50']:.2f}s, max {s['ttft_s_max']:.2f}s")
        elif s:
            lines.append(f"{r['model']} end to end: {s}")
        for B, m in sorted(r["batches"].items(), key=lambda kv: int(kv[0])):
            if "error" in m:
                lines.append(f"{r['model']} B={B}: {m['error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON result path (rewritten as it grows)")
    p.add_argument("--budget", type=float, default=230.0, help="seconds for the whole run (default 230)")
    p.add_argument("--workdir", default="/tmp/rjax-serving-bench", help="synthetic GGUFs and compilation cache")
    p.add_argument("--batches", type=_ints, default=BATCHES, help="batch sizes, e.g. 1,8,64")
    p.add_argument("--models", default=None,
                   help="shape:mix list (default llama-1b:q4_k,llama-8b:q4_k; with --smoke smollm2-135m:q8_0)")
    p.add_argument("--context", type=int, default=512, help="positions each slot already holds")
    p.add_argument("--steps", type=int, default=16, help="decode steps per dispatch")
    p.add_argument("--dispatches", type=int, default=4, help="timed dispatches per batch size")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reserve-mib", type=int, default=2048, help="device memory left free (MiB)")
    p.add_argument("--workers", type=int, default=min(9, os.cpu_count() or 1), help="parallel compiles")
    p.add_argument("--serve-requests", type=int, default=256,
                   help="requests run end to end through ServingEngine on the first model (0: off)")
    p.add_argument("--serve-prompt", type=int, default=128)
    p.add_argument("--serve-gen", type=int, default=128)
    p.add_argument("--no-compilation-cache", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny 2-layer shapes for a CPU check of the script")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every slot samples at this temperature (the dispatch that samples; 0: greedy slots and "
                        "the engine's greedy program)")
    p.add_argument("--top-p", type=float, default=1.0, help="every sampling slot's top-p (< 1: the program with the filters)")
    a = p.parse_args(argv)
    start = time.perf_counter()

    synth_kw: dict = {}
    if a.smoke:
        a.context, a.steps, a.dispatches, a.reserve_mib = 32, 4, 2, 0
        a.serve_requests, a.serve_prompt, a.serve_gen = min(a.serve_requests, 8), 16, 8
        if a.batches == BATCHES:
            a.batches = (1, 4, 16)
        a.models = a.models or "smollm2-135m:q8_0"
        synth_kw = dict(n_layers=2, vocab_size=512, tokenizer_from="builtin")
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    if not a.no_compilation_cache:
        jax.config.update("jax_compilation_cache_dir", str(Path(a.workdir) / "xla-cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

    models = [tuple(m.split(":")) for m in (a.models or ",".join(f"{s}:{q}" for s, q, _ in MODELS)).split(",") if m]
    bad = [":".join(m) for m in models if len(m) != 2 or not all(m)]
    if bad:
        p.error(f"--models takes shape:mix items (e.g. llama-1b:q4_k), got {', '.join(bad)}")
    shares = {s: w for s, _, w in MODELS}
    result = dict(device=str(jax.devices()[0]), backend=jax.default_backend(), jax=jax.__version__,
                  settings=dict(batches=list(a.batches), context=a.context, steps=a.steps, dispatches=a.dispatches,
                                temperature=a.temperature, top_p=a.top_p,
                                page_size=a.page_size, budget_s=a.budget, smoke=a.smoke),
                  models=[], target=None)
    for i, (shape, quant) in enumerate(models):
        row = dict(model=f"{shape} {quant}", batches={})
        result["models"].append(row)
        remaining = a.budget - (time.perf_counter() - start)
        weight = shares.get(shape, 1.0)
        share = remaining * weight / sum(shares.get(s, 1.0) for s, _ in models[i:])
        try:
            run_model(shape, quant, a.batches, a, time.perf_counter() + share, result, row, synth_kw)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            say(f"{shape} {quant}: {row['error']}")
        write_json(result, a.out)

    shape, slots, need = TARGET
    for r in result["models"]:
        if r["model"].startswith(shape + " "):
            got = r["batches"].get(str(slots), {}).get("speedup_over_b1")
            result["target"] = dict(model=r["model"], slots=slots, min_speedup=need, speedup=got,
                                    met=bool(got is not None and got >= need))
    result["wall_s"] = time.perf_counter() - start
    write_json(result, a.out)
    print(format_table(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
