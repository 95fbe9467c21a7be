"""`rjax bench`: prefill and decode throughput, latency, compile time and memory, beside the
memory-bandwidth roofline measured in the same run.

What is measured (one model, random prompts of `prompt_len` token ids):
- HBM bandwidth: the fastest of several probes over a large device array (a device-to-device
  copy, elementwise passes; `rjax.engine.roofline.measure_bandwidth`), counting bytes read + written,
  the fastest of several runs each, beside the device's nominal figure where it is known. The
  fastest is the ceiling every decode step is held against: a slower probe or run would
  overstate the fraction reached.
- compile: every program the run calls (prefill per batch size, decode per batch size and N)
  is lowered, then compiled concurrently in threads before anything is timed
  (rjax.engine.precompile); the total is the lowering time plus the compiles' wall time, plus what
  first calls still spend beyond a steady call. `compile_workers=0` compiles each program at
  its first call instead, one after another.
- prefill per batch size: first call (trace + compile + run) and steady calls of
  `engine.prefill_and_sample`; time to first token is a steady call at batch 1 up to the
  first token on the host; prefill tokens/s = batch x prompt_len / that time.
- decode per (batch, steps per dispatch N): `engine.greedy_decode_loop` from a prefilled cache, with
  a stop set that never matches and a budget beyond the run, so every slot generates every
  step. The first dispatch (compile) is excluded; each timed run starts from a copy of the
  same prefilled cache and makes ceil(gen / N) dispatches, each synced by fetching its tokens.
  tokens/s = generated tokens / time; per-token latency = dispatch time / N (p50/p90/p99);
  host time per token = time for the dispatch call to return / N (the launch overhead that
  more steps per dispatch amortize).
- roofline: bytes one decode step must read = weights (all of them, except an untied
  embedding table of which only the batch's rows are read) + the KV cache of every sequence
  at the run's mean context (window-limited for sliding-window layers). ceiling tokens/s =
  batch x bandwidth / bytes; the fraction achieved is measured / ceiling.
- recompilation: the number of programs each jitted function compiles is counted
  (`compiled_count`): one per batch size for prefill (a second prompt length in the same bucket
  must reuse it), one per (batch, N) for decode, none for repeated runs.
- peak device memory from `memory_stats()` where the backend has it (GPUs; not the CPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from rjax.cli.bench_report import _pyplot, format_table, plot, summarize, write_json
from rjax.engine import steps as engine
from rjax.engine.precompile import compile_programs, decode_program, prefill_program
from rjax.engine.roofline import (decode_weight_bytes, kv_bytes_per_sequence, measure_bandwidth, memory_stats, roofline,
                                  weight_bytes, weight_types)
from rjax.loading.catalog import DEFAULT_MODEL, resolve_model
from rjax.loading.loaders import for_backend, load, split_for_backend
from rjax.loading.loaders.gguf import load_gguf
from rjax.math.cache import KV_DTYPES, check_kv_dtype, init_cache
from rjax.math.config import ModelConfig
from rjax.math.params import Params
from rjax.math.sampling import SamplingParams
from rjax.math.tensor_parallel import make_tp, place_cache, split_config
from rjax.runtime.generation import activation_dtype, cache_length


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    prompt_len: int = 512
    gen: int = 128
    batches: tuple[int, ...] = (1, 8, 32)
    # 128: a tg128 run in one dispatch. Each dispatch costs the host's call and sync on top of its
    # steps, which weighs most at N = 1 (docs/kernels.md, "The decode step").
    steps_per_dispatch: tuple[int, ...] = (1, 16, 128)
    repeats: int = 3
    copy_bytes: int = 1 << 30      # bandwidth probe array size
    copy_repeats: int = 5
    seed: int = 0
    time_budget_s: float | None = None  # seconds of measuring (after load and compile), then the rest "skipped"
    # Compile the run's programs before measuring, in this many threads (None: one per program
    # up to the CPU count; 0: each at its first call, one after another).
    compile_workers: int | None = None
    kv_dtype: str = "bf16"         # how the KV cache stores K/V (rjax.math.cache.KV_DTYPES)
    tp: int = 1                    # devices the model is split over (rjax.math.tensor_parallel)

    def __post_init__(self):
        check_kv_dtype(self.kv_dtype)
        if self.prompt_len < 1 or self.gen < 1 or self.repeats < 1:
            raise ValueError(f"prompt_len, gen and repeats must be >= 1 (got {self.prompt_len}, "
                             f"{self.gen}, {self.repeats})")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batches}")
        if not self.steps_per_dispatch or min(self.steps_per_dispatch) < 1:
            raise ValueError(f"steps per dispatch must be >= 1, got {self.steps_per_dispatch}")
        if self.compile_workers is not None and self.compile_workers < 0:
            raise ValueError(f"compile_workers must be >= 0, got {self.compile_workers}")


# measurements

def _percentiles(values) -> dict:
    v = np.asarray(values, np.float64)
    if v.size == 0:
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}


def load_for_bench(model: str | os.PathLike, progress: bool = True, tp: int = 1) -> tuple[ModelConfig, Params, Path]:
    """(config, params on the device(s), path). GGUF files skip the tokenizer: prompts are ids.
    tp > 1: the model split over that many devices (rjax.math.tensor_parallel)."""
    path = Path(resolve_model(model, progress=progress))
    mesh = make_tp(tp).mesh if tp > 1 else None
    if path.is_dir():
        m = load(path, progress=progress, mesh=mesh)
        cfg, params = m.config, m.params
    else:  # as rjax.load arranges them
        cfg, params, _ = load_gguf(path, progress=progress, on_device=mesh is None)
        params = (for_backend(params, consume=True) if mesh is None
                  else split_for_backend(cfg, params, mesh, progress=progress)[1])
        cfg = cfg if mesh is None else split_config(cfg, tp)
    jax.block_until_ready(params)
    return cfg, params, path


def _random_prompts(rng: np.random.Generator, vocab: int, batch: int, length: int) -> np.ndarray:
    return rng.integers(0, vocab, (batch, length), dtype=np.int32)


class _Budget:
    def __init__(self, seconds: float | None):
        self.deadline = None if seconds is None else time.perf_counter() + seconds

    def exhausted(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline


def _copy_cache(cache):
    return jax.tree.map(jnp.copy, cache)


def run_bench(model: str | os.PathLike | tuple[ModelConfig, Params], settings: BenchSettings = BenchSettings(), *,
              progress: bool = True, on_update: Callable[[dict], None] | None = None,
              log: Callable[[str], None] | None = None) -> dict:
    """Run every measurement and return the result (see `RESULT_KEYS`). `model` is a catalog
    name or path, or an already loaded (config, params). `on_update(result)` is called after
    each measurement with the result so far (for writing it out as it grows)."""
    s = settings
    say = log or (lambda msg: None)
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    result: dict = {
        "rjax_bench_version": 1,
        "device": {"platform": dev.platform, "kind": dev.device_kind, "count": jax.device_count(),
                   "jax_version": jax.__version__},
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(s).items()},
        "status": "running", "skipped": [], "errors": [],
    }

    def update():
        result["elapsed_s"] = time.perf_counter() - t_start
        if on_update is not None:
            on_update(result)

    # Bandwidth first, before the model takes its memory.
    bw = measure_bandwidth(s.copy_bytes, s.copy_repeats)
    result["bandwidth"] = bw
    # memory_stats' peak is process-wide and cannot be reset: note what the probe alone reached.
    result["memory"] = {"after_bandwidth_probe": memory_stats()}
    nominal = f", nominal {bw['nominal_gb_per_s']:.0f} GB/s" if bw["nominal_gb_per_s"] else ""
    say(f"bandwidth: {bw['gb_per_s']:.1f} GB/s by {bw['probe']} ({bw['array_bytes'] / 2**20:.0f} MiB array; "
        + ", ".join(f"{k} {v['gb_per_s']:.1f}" for k, v in bw["probes"].items()) + f"{nominal})")
    update()

    t0 = time.perf_counter()
    if isinstance(model, tuple):
        cfg, params = model
        source = None
    else:
        cfg, params, source = load_for_bench(model, progress=progress, tp=s.tp)
    load_s = time.perf_counter() - t0
    dtype = activation_dtype()
    # K/V bytes per cached value: int8 carries a float32 scale per head_dim values.
    itemsize = {"int8": 1 + 4 / cfg.head_dim, "fp8": 1}.get(s.kv_dtype, jnp.dtype(dtype).itemsize)
    result["model"] = {
        "source": str(source) if source else None, "tp": s.tp, "arch": cfg.arch, "n_layers": cfg.n_layers,
        "d_model": cfg.d_model, "d_ff": cfg.d_ff, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "tied_embeddings": params.lm_head is None,
        "weight_bytes": weight_bytes(params), "weight_types": weight_types(params),
        "activation_dtype": jnp.dtype(dtype).name, "load_s": load_s,
    }
    result["memory"]["after_load"] = memory_stats()
    say(f"loaded {source or cfg.arch}: {result['model']['weight_bytes'] / 1e9:.3f} GB of weights in {load_s:.1f} s")

    if s.prompt_len >= cfg.context_length:
        raise ValueError(f"prompt length {s.prompt_len} does not fit the context of {cfg.context_length}")
    bucket = engine.prompt_bucket(s.prompt_len)
    warm_tokens = max(s.steps_per_dispatch)
    S = cache_length(s.prompt_len + warm_tokens + s.gen + 1, cfg.context_length)
    if s.prompt_len + s.gen + 1 > S:
        raise ValueError(f"prompt {s.prompt_len} + {s.gen} generated tokens do not fit the context of "
                         f"{cfg.context_length}")
    mean_context = s.prompt_len + 1 + s.gen / 2  # positions held, averaged over the timed steps
    kv_seq = kv_bytes_per_sequence(cfg, mean_context, itemsize)
    result["settings"].update(prompt_bucket=bucket, cache_len=S, mean_context=mean_context,
                              kv_bytes_per_sequence=kv_seq)
    result.update(prefill=[], decode=[], compile={"prefill_and_sample": {}, "decode_loop": {}})
    update()

    rng = np.random.default_rng(s.seed)
    stop_ids = jnp.asarray([-1], jnp.int32)  # token ids are >= 0: never stops
    key = jax.random.key(s.seed)
    batches = list(dict.fromkeys(s.batches))
    steps = sorted(set(s.steps_per_dispatch), reverse=True)
    # Headline numbers first, in case the time budget runs out: every batch (prefill, then decode
    # with the most steps per dispatch), then the other step counts. n None: prefill.
    tasks = [t for b in batches for t in ((b, None), (b, steps[0]))] + [(b, n) for n in steps[1:] for b in batches]
    n_prefill_programs = engine.prefill_and_sample.compiled_count()
    n_decode_programs = engine.greedy_decode_loop.compiled_count()
    expected_prefill, expected_decode = 0, 0
    alt_len_checked = False
    templates: dict[int, object] = {}

    if s.compile_workers != 0:
        _compile_ahead(cfg, params, s, tasks, bucket, S, dtype, result, progress, say)
        update()

    # The budget counts the measurements only: loading and the compile ahead take what they take.
    budget = _Budget(s.time_budget_s)
    bar = tqdm(tasks, desc="bench", unit="run", disable=not progress, leave=False)
    for b, n in bar:
        label = f"prefill B={b}" if n is None else f"decode B={b} N={n}"
        bar.set_postfix_str(label)
        if budget.exhausted():
            result["skipped"].append(label)
            update()
            continue
        if n is not None and b not in templates:
            result["skipped"].append(label)  # its prefill failed or was skipped
            continue
        try:
            if n is None:
                entry, templates[b] = _bench_prefill(cfg, params, s, b, S, dtype, rng, key, budget)
                expected_prefill += 1
                if not alt_len_checked:
                    entry["same_bucket_length"] = _check_bucket_reuse(cfg, params, s, b, S, dtype, rng, key)
                    alt_len_checked = True
                result["prefill"].append(entry)
                result["compile"]["prefill_and_sample"][f"B={b}"] = entry["compile_s"]
                say(f"{label}: {entry['tokens_per_s']:,.0f} tokens/s, {entry['time_s'] * 1e3:.1f} ms, "
                    f"first call {entry['first_call_s']:.1f} s")
            else:
                entry = _bench_decode(cfg, params, s, b, n, templates[b], key, stop_ids, budget)
                expected_decode += 1
                rf = roofline(decode_weight_bytes(cfg, params, b), kv_seq, b, bw["bytes_per_s"])
                entry["roofline"] = rf
                entry["roofline_fraction"] = entry["tokens_per_s"] / rf["tokens_per_s"]
                result["decode"].append(entry)
                result["compile"]["decode_loop"][f"B={b},N={n}"] = entry["compile_s"]
                say(f"{label}: {entry['tokens_per_s']:,.1f} tokens/s, p50 {entry['per_token_s']['p50'] * 1e3:.2f} "
                    f"ms/token, {100 * entry['roofline_fraction']:.0f}% of the {rf['tokens_per_s']:,.0f} tokens/s "
                    f"roofline, first call {entry['first_call_s']:.1f} s")
        except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the others
            result["errors"].append({"run": label, "error": f"{type(e).__name__}: {e}"})
            say(f"{label}: FAILED {type(e).__name__}: {e}")
        update()
    bar.close()
    templates.clear()

    result["recompilation"] = {
        "prefill_and_sample": {"programs": engine.prefill_and_sample.compiled_count() - n_prefill_programs,
                               "expected": expected_prefill},
        "decode_loop": {"programs": engine.greedy_decode_loop.compiled_count() - n_decode_programs,
                        "expected": expected_decode},
    }
    for v in result["recompilation"].values():
        v["ok"] = v["programs"] == v["expected"]
    result["memory"]["end"] = memory_stats()
    result["summary"] = summarize(result)
    result["status"] = "done" if not result["skipped"] and not result["errors"] else "partial"
    update()
    return result


def _compile_ahead(cfg, params, s: BenchSettings, tasks, bucket, S, dtype, result, progress, say) -> None:
    """Every program the run will call, compiled concurrently before it is timed (what a
    server's start-up costs); result["compile"]["ahead"]. A failure is recorded and the
    programs then compile at their first calls."""
    programs = [prefill_program(cfg, params, b, bucket, S, dtype, kv_dtype=s.kv_dtype) if n is None else
                decode_program(cfg, params, b, S, dtype, n, n_stop_ids=1, kv_dtype=s.kv_dtype, greedy=True) for b, n in tasks]
    try:
        report = compile_programs(programs, s.compile_workers, progress=progress)
    except Exception as e:  # noqa: BLE001
        result["errors"].append({"run": "compile ahead", "error": f"{type(e).__name__}: {e}"})
        say(f"compile ahead: FAILED {type(e).__name__}: {e}")
        return
    result["compile"]["ahead"] = {"workers": report.workers, "lower_s": report.lower_s, "wall_s": report.wall_s,
                                  "total_s": report.total_s, "programs": report.compile_s}
    say(f"compiled {len(programs)} programs in {report.total_s:.1f} s (lowering {report.lower_s:.1f} s, then "
        f"{report.wall_s:.1f} s in {report.workers} threads; {sum(report.compile_s.values()):.1f} s of compiles)")


def _bench_prefill(cfg, params, s: BenchSettings, b, S, dtype, rng, key, budget):
    tokens, lengths = engine.pad_prompts(list(_random_prompts(rng, cfg.vocab_size, b, s.prompt_len)))
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    sp = SamplingParams.make(b)

    def run():
        cache = place_cache(init_cache(cfg, b, S, dtype, s.kv_dtype), params.tp)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        first, cache = engine.prefill_and_sample(cfg, params, cache, tokens, lengths, None, key, sp)
        first = np.asarray(first)
        return time.perf_counter() - t0, first, cache

    before = engine.prefill_and_sample.compiled_count()
    first_call, _, template = run()
    times = []
    for _ in range(s.repeats):
        if times and budget.exhausted():
            break
        dt, first, template = run()
        times.append(dt)
    t = float(np.median(times))
    entry = dict(batch=b, prompt_len=s.prompt_len, first_call_s=first_call, compile_s=max(0.0, first_call - t),
                 time_s=t, samples_s=times, ttft_s=t, tokens_per_s=b * s.prompt_len / t,
                 programs_compiled=engine.prefill_and_sample.compiled_count() - before)
    jax.block_until_ready(template)
    return entry, (template, jnp.asarray(first))


def _check_bucket_reuse(cfg, params, s: BenchSettings, b, S, dtype, rng, key) -> dict:
    """Prefill a different prompt length of the same bucket: it must reuse the compiled program."""
    bucket = engine.prompt_bucket(s.prompt_len)
    lower = max([x for x in engine.PROMPT_BUCKETS if x < bucket], default=0)
    alt = lower + 1 if lower + 1 != s.prompt_len else min(bucket, s.prompt_len + 1)
    if alt == s.prompt_len or engine.prompt_bucket(alt) != bucket:
        return {"prompt_len": alt, "checked": False}
    tokens, lengths = engine.pad_prompts(list(_random_prompts(rng, cfg.vocab_size, b, alt)))
    before = engine.prefill_and_sample.compiled_count()
    cache = place_cache(init_cache(cfg, b, S, dtype, s.kv_dtype), params.tp)
    first, cache = engine.prefill_and_sample(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths), None,
                                             key, SamplingParams.make(b))
    np.asarray(first)
    new = engine.prefill_and_sample.compiled_count() - before
    return {"prompt_len": alt, "checked": True, "new_programs": new, "ok": new == 0}


def _bench_decode(cfg, params, s: BenchSettings, b, n, prefilled, key, stop_ids, budget) -> dict:
    """`prefilled`: (the cache after prefill, the first tokens it sampled); never donated."""
    template, first = prefilled
    sp = SamplingParams.make(b)
    # A budget beyond the run and a stop set that never matches: every slot decodes every step.
    room = template.max_len - s.prompt_len
    n_dispatches = math.ceil(s.gen / n)

    def fresh_state():
        cache = _copy_cache(template)
        state = engine.initial_state(first, jnp.full((b,), room, jnp.int32), stop_ids, key, cache)
        jax.block_until_ready((cache, state))
        return cache, state

    before = engine.greedy_decode_loop.compiled_count()
    cache, state = fresh_state()
    t0 = time.perf_counter()
    out, state, cache = engine.greedy_decode_loop(cfg, params, cache, state, sp, stop_ids, n)
    np.asarray(out)
    first_call = time.perf_counter() - t0
    programs = engine.greedy_decode_loop.compiled_count() - before
    del cache, state

    dispatch_s, host_s, run_rates, tokens_total, time_total = [], [], [], 0, 0.0
    for r in range(s.repeats):
        if r and budget.exhausted():
            break
        cache, state = fresh_state()
        run_tokens, run_time = 0, 0.0
        for _ in range(n_dispatches):
            t0 = time.perf_counter()
            out, state, cache = engine.greedy_decode_loop(cfg, params, cache, state, sp, stop_ids, n)
            t1 = time.perf_counter()
            out = np.asarray(out)
            t2 = time.perf_counter()
            dispatch_s.append(t2 - t0)
            host_s.append(t1 - t0)
            run_tokens += int((out >= 0).sum())
            run_time += t2 - t0
        if run_tokens != b * n * n_dispatches:
            raise RuntimeError(f"decode B={b} N={n} generated {run_tokens} tokens, expected "
                               f"{b * n * n_dispatches}: a slot stopped early")
        run_rates.append(run_tokens / run_time)
        tokens_total += run_tokens
        time_total += run_time
        del cache, state
    steady = float(np.median(dispatch_s))
    per_token = np.asarray(dispatch_s) / n
    return dict(batch=b, steps_per_dispatch=n, dispatches_per_run=n_dispatches, runs=len(run_rates),
                tokens=tokens_total, time_s=time_total,
                tokens_per_s=float(np.median(run_rates)), tokens_per_s_runs=run_rates,
                per_token_s=_percentiles(per_token),
                per_sequence_tokens_per_s=float(np.median(run_rates)) / b,
                dispatch_s=_percentiles(dispatch_s),
                host_s_per_token=float(np.median(host_s)) / n,
                first_call_s=first_call, compile_s=max(0.0, first_call - steady), programs_compiled=programs)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def cmd_bench(a) -> int:
    if a.plot:  # before minutes of measuring, not after
        try:
            _pyplot()
        except RuntimeError as e:
            print(f"rjax: error: {e}", file=sys.stderr)
            return 2
    # Compile times are part of what is measured: leave the command's persistent compilation
    # cache off unless asked (with it, "compile" is the time to load a cached program).
    jax.config.update("jax_enable_compilation_cache", bool(a.compilation_cache))
    default_copy = (1 << 30) if jax.default_backend() != "cpu" else (64 << 20)
    settings = BenchSettings(prompt_len=a.prompt_len, gen=a.gen, batches=a.batch, steps_per_dispatch=a.steps_per_dispatch,
                             repeats=a.repeats, copy_bytes=int(a.copy_mib * 2**20) if a.copy_mib else default_copy,
                             seed=a.seed, time_budget_s=a.time_budget, compile_workers=a.compile_workers,
                             kv_dtype=a.kv_dtype, tp=a.tp)
    on_update = (lambda r: write_json(r, a.json)) if a.json else None

    def log(msg):
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    result = run_bench(a.model, settings, progress=not a.quiet and sys.stderr.isatty(), on_update=on_update,
                       log=None if a.quiet else log)
    result["settings"]["persistent_compilation_cache"] = bool(a.compilation_cache)
    if a.json:
        write_json(result, a.json)
    if a.plot:
        plot(result, a.plot)
    print(format_table(result), flush=True)
    return 0 if not result["errors"] else 1


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("bench", help="prefill/decode throughput, latency, compile time and roofline",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default=DEFAULT_MODEL, help=f"catalog name or path (default: {DEFAULT_MODEL})")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen", type=int, default=128, help="tokens generated per timed decode run")
    p.add_argument("--batch", type=_int_list, default=(1, 8, 32), help="batch sizes, e.g. 1,8,32")
    p.add_argument("--steps-per-dispatch", type=_int_list, default=BenchSettings.steps_per_dispatch,
                   help="decode steps per dispatch, e.g. 1,16,128")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration")
    p.add_argument("--copy-mib", type=float, default=None,
                   help="bandwidth probe array size in MiB (default 1024 on accelerators, 64 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="split the model over this many GPUs (tensor parallel; default 1)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                   help="KV cache: bf16 (unquantized, in the activation dtype), int8 or fp8 (default bf16)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="skip the remaining measurements after this long, counted from the end of loading "
                        "and compiling (they are listed as skipped)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the result here (rewritten as it grows)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="plot tokens/s against batch size (matplotlib)")
    p.add_argument("--compile-workers", type=int, default=None, metavar="N",
                   help="compile the run's programs ahead in N threads (default: one per program, up to the "
                        "CPU count; 0: each at its first call)")
    p.add_argument("--compilation-cache", action="store_true",
                   help="use the persistent compilation cache (compile times then measure cache loads)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output, only the final table")
    p.set_defaults(func=cmd_bench)
