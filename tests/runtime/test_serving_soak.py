"""Soak: many requests through one `rjax.ServingEngine`, in waves with arrivals mid-run, with mixed
prompt lengths, token budgets and sampling settings (greedy and sampled, several top_k / top_p /
temperatures, a seed each, some with a stop id). Checked along the way:

- host memory (RSS, after garbage collection and a malloc_trim) sampled every `sample_every`
  finished requests stays flat after warm-up (`growth`: within 5%), and so does device memory
  where the device reports it;
- no XLA program is compiled after warm-up (every backend compile is counted through
  jax.monitoring's "/jax/core/compile/backend_compile_duration" event, which XLA compilations
  and persistent-cache loads both report; the counter is checked on a fresh program first);
- every greedy completion equals its prompt run alone through `rjax.engine.steps` functions (a
  one-slot contiguous cache, `engine.prefill_and_sample` then `engine.decode_loop`; the server
  runs its own paged dispatch of `engine.decode_step` and its own sampling over 8 slots).

`soak(n_requests, ...)` returns a report dict; the CPU tests call it on the small synthetic model,
the GPU test on the default-size synthetic smoke model (smollm2-135m's shape) and prints it.
From a shell on a GPU machine: `python tests/runtime/test_serving_soak.py --requests 2000 --smoke-model`.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import gc
import itertools
import json
import os
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rjax.engine import steps as engine
from rjax.math.cache import init_cache
from rjax.math.sampling import SamplingParams
from rjax.runtime.serving import ServingConfig, ServingEngine

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_probe_sizes = itertools.count(1)  # a new shape for every probe: never a cached program

# The CPU geometry: 8 slots of 64 positions in pages of 8, prompts packed 2 or 8 to a prefill
# call (4 prefill programs: 2 x 16, 2 x 32, 2 x 64, 8 x 16), 4 decode steps per dispatch.
CPU_CONFIG = ServingConfig(n_slots=8, max_len=64, page_size=8, steps_per_dispatch=4, prefill_buckets=(2, 8),
                           max_prefill_tokens=128)
# The GPU geometry: 32 slots of 256 positions in bfloat16 pages of 16.
GPU_CONFIG = ServingConfig(n_slots=32, max_len=256, page_size=16, steps_per_dispatch=8, prefill_buckets=(4, 16),
                           max_prefill_tokens=1024, kv_dtype="bfloat16")


class CompileCounter:
    """Names of the XLA programs compiled (or loaded from the persistent cache) while active."""

    def __init__(self):
        self.names: list[str] = []
        self._listener = self._on_event  # one bound method, so that unregistering finds it

    def _on_event(self, event: str, duration: float, **kw) -> None:
        if event == COMPILE_EVENT:
            self.names.append(str(kw.get("fun_name", "?")))

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)


def rss_bytes() -> int:
    """This process's resident set size now (Linux: /proc/self/statm; elsewhere the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trimmed_rss_bytes() -> tuple[int, int]:
    """(RSS, RSS after collecting garbage and handing glibc's free heap pages back to the system).
    The second is what a leak would grow: without the trim, RSS steps up and down by tens of MiB
    as glibc's malloc keeps or returns freed blocks (a soak of the small model on the CPU saw
    +60 MiB from one sample to the next, flat after, and -60 MiB at the end)."""
    before = rss_bytes()
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return before, rss_bytes()


def device_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get("bytes_in_use", 0))


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_ids: tuple[int, ...]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def workload(n: int, vocab: int, max_len: int, max_new: int, seed: int) -> list[Request]:
    """n requests: prompt lengths over three length buckets (the longest leave room for the
    budget, so none ends at the cache's end), budgets 1..max_new, half greedy (some of those
    with top_k / top_p set, which greedy ignores), one in five with a stop id."""
    rng = np.random.default_rng(seed)
    ranges = [(1, 16), (17, 32), (33, max_len - max_new)]
    out = []
    for _ in range(n):
        lo, hi = ranges[rng.choice(3, p=[0.5, 0.3, 0.2])]
        prompt = tuple(int(t) for t in rng.integers(0, vocab, int(rng.integers(lo, hi + 1))))
        if rng.random() < 0.5:
            t, k, p = 0.0, int(rng.choice([0, 0, 3])), float(rng.choice([1.0, 1.0, 0.5]))
        else:
            t = float(rng.choice([0.3, 0.7, 1.0, 1.5]))
            k, p = int(rng.choice([0, 1, 5, 50])), float(rng.choice([1.0, 0.95, 0.5, 0.1]))
        stop = (int(rng.integers(vocab)),) if rng.random() < 0.2 else ()
        out.append(Request(prompt, int(rng.integers(1, max_new + 1)), t, k, p, int(rng.integers(2**63)), stop))
    return out


def solo_greedy(cfg, params, r: Request, max_len: int, dtype, n_steps: int) -> list[int]:
    """The request's greedy tokens with its prompt alone in a one-slot contiguous cache, through
    `engine.prefill_and_sample` and one `engine.decode_loop` of `n_steps` (>= its budget - 1)."""
    cache = init_cache(cfg, 1, max_len, dtype)
    t, l = engine.pad_prompts([list(r.prompt)])
    sp, key = SamplingParams.make(1), jax.random.key(0)
    first, cache = engine.prefill_and_sample(cfg, params, cache, jnp.asarray(t), jnp.asarray(l), None, key, sp)
    stop = jnp.asarray([r.stop_ids[0] if r.stop_ids else -1], jnp.int32)  # one shape: one program
    state = engine.initial_state(first, r.max_new_tokens, stop, key, cache)
    out, _, _ = engine.decode_loop(cfg, params, cache, state, sp, stop, n_steps)
    return [int(first[0])] + [int(x) for x in np.asarray(out)[0] if x >= 0]


def soak(n_requests: int, cfg, params, *, config: ServingConfig = CPU_CONFIG, max_new: int = 12, seed: int = 0,
         warmup_requests: int = 100, sample_every: int = 100, check_solo: bool = True, log=None) -> dict:
    """Run `n_requests` through one ServingEngine and report memory, compilations and greedy
    agreement. Warm-up: `engine.precompile()` (every prefill shape and the decode dispatch),
    then the first `warmup_requests` finished requests; compilations after that are listed
    in `compiles_after_warmup`, and how much RSS (and device memory) grew after it in
    `rss_growth` (see `growth`), its range in `rss_spread`.

    -> dict with rss_samples / device_samples [(finished requests, bytes)], compile lists,
    greedy_checked / greedy_mismatches, finish reasons, timings."""
    say = log or (lambda *a: None)
    rng = np.random.default_rng(seed + 1)
    requests = workload(n_requests, cfg.vocab_size, config.max_len, max_new, seed)
    report: dict = dict(n_requests=n_requests, backend=jax.default_backend(), device=str(jax.devices()[0]),
                        config=dataclasses.asdict(config), max_new=max_new, seed=seed,
                        warmup_requests=warmup_requests)
    with CompileCounter() as counter:
        # The counter sees a real compile: a program no one has compiled before.
        jax.jit(lambda x: x * 3 + 1)(np.zeros(next(_probe_sizes) + 1000, np.float32)).block_until_ready()
        assert counter.names, f"no {COMPILE_EVENT} event for a fresh program: the compile counter is blind"
        counter.names.clear()

        t0 = time.perf_counter()
        eng = ServingEngine(cfg, params, config, seed=seed)
        pre = eng.precompile()
        report["precompile_s"] = pre.total_s
        say(f"precompiled {len(pre.compiled)} programs in {pre.total_s:.1f}s")

        pending = collections.deque(enumerate(requests))
        by_id: dict[int, Request] = {}
        done: dict[int, list[int]] = {}
        reasons: collections.Counter = collections.Counter()
        rss, rss_raw, dev, warm_compiles = [], [], [], None
        steps = most = generated = 0
        t_warm = None

        def submit(k):
            for _ in range(min(k, len(pending))):
                i, r = pending.popleft()
                rid = eng.submit(list(r.prompt), max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                 top_k=r.top_k, top_p=r.top_p, stop_ids=r.stop_ids, seed=r.seed, request_id=i)
                by_id[rid] = r

        while pending or eng.has_work:
            # Waves: a burst when the engine is idle (or now and then), else a few arrivals mid-run.
            if pending and (not eng.has_work or rng.random() < 0.15):
                submit(int(rng.integers(1, 3 * config.n_slots + 1)))
            elif pending and rng.random() < 0.5:
                submit(int(rng.integers(1, 4)))
            for e in eng.step():
                generated += len(e.tokens)
                if not e.finished:
                    continue
                c = e.completion
                r = by_id.pop(c.request_id)
                assert 1 <= len(c.tokens) <= r.max_new_tokens and all(0 <= t < cfg.vocab_size for t in c.tokens)
                assert c.finish_reason in ("stop", "length"), (c.request_id, c.finish_reason)
                reasons[c.finish_reason] += 1
                done[c.request_id] = c.tokens if r.greedy else None
                n_done = len(done)
                if n_done % sample_every == 0 or n_done == n_requests:
                    raw, trimmed = trimmed_rss_bytes()
                    rss.append((n_done, trimmed))
                    rss_raw.append((n_done, raw))
                    dev.append((n_done, device_bytes()))
                    say(f"{n_done:5d} finished  rss {trimmed / 2**20:8.1f} MiB (untrimmed {raw / 2**20:8.1f})"
                        + (f"  device {dev[-1][1] / 2**20:8.1f} MiB" if dev[-1][1] is not None else "")
                        + f"  compiles {len(counter.names)}")
                if n_done == warmup_requests:
                    warm_compiles, counter.names[:] = list(counter.names), []
                    t_warm = time.perf_counter()
            steps += 1
            most = max(most, eng.n_running)
        wall = time.perf_counter() - t0
        after = list(counter.names) if warm_compiles is not None else []
    report.update(wall_s=wall, steady_s=(time.perf_counter() - t_warm) if t_warm else None, steps=steps,
                  most_running=most, generated_tokens=generated, finish_reasons=dict(reasons),
                  rss_samples=rss, rss_untrimmed_samples=rss_raw, device_samples=[d for d in dev if d[1] is not None],
                  compiles_in_warmup=warm_compiles if warm_compiles is not None else list(counter.names),
                  compiles_after_warmup=after)
    report.update(rss_growth=growth(rss, warmup_requests), rss_spread=spread(rss, warmup_requests),
                  device_growth=growth(report["device_samples"], warmup_requests))
    assert not pending and not by_id and len(done) == n_requests

    greedy = [i for i, r in enumerate(requests) if r.greedy]
    report["greedy_requests"] = len(greedy)
    if check_solo:
        t = time.perf_counter()
        dtype = jnp.dtype(config.kv_dtype)
        n_steps = max(1, max_new - 1)
        mismatches = [i for i in greedy
                      if done[i] != solo_greedy(cfg, params, requests[i], config.max_len, dtype, n_steps)]
        report.update(greedy_checked=len(greedy), greedy_mismatches=mismatches, solo_s=time.perf_counter() - t)
    return report


def growth(samples, warmup: int) -> float | None:
    """How much the samples taken after warm-up grew: the median of their second half over the
    median of their first half, minus 1. A leak moves every later sample; a block held for a
    while (a thread's buffer, tens of MiB on the CPU) moves one, which the median ignores."""
    post = [b for n, b in samples if n >= warmup]
    if len(post) < 2:
        return None
    half = len(post) // 2
    return float(np.median(post[half:]) / np.median(post[:half]) - 1)


def spread(samples, warmup: int) -> float | None:
    post = [b for n, b in samples if n >= warmup]
    return float(max(post) / min(post) - 1) if post else None


def _print_report(report: dict) -> None:
    """The figures on one line each, then the memory samples in MiB."""
    series = ("rss_samples", "rss_untrimmed_samples", "device_samples")
    for k, v in report.items():
        if k in series or k == "config":
            continue
        if k == "compiles_in_warmup":
            v = dict(collections.Counter(v))
        print(f"{k}: {json.dumps(v, default=str)}")
    for k in series:
        print(f"{k} (MiB): " + ", ".join(f"{n}: {b / 2**20:.1f}" for n, b in report[k]))


# --- tests ------------------------------------------------------------------------------------

def _check(report: dict, max_growth: float = 0.05) -> None:
    assert report["compiles_after_warmup"] == [], f"compiled after warm-up: {report['compiles_after_warmup']}"
    assert report["rss_growth"] is not None and report["rss_growth"] <= max_growth, report["rss_samples"]
    assert report["greedy_checked"] > 0 and report["greedy_mismatches"] == [], report["greedy_mismatches"]


def test_compile_counter_counts_a_real_compile():
    with CompileCounter() as counter:
        f = jax.jit(lambda x: x * 5 - 1)
        f(np.ones(3, np.float32)).block_until_ready()
        f(np.ones(3, np.float32)).block_until_ready()  # the same shape: no second compile
        n = len(counter.names)
        f(np.ones(4, np.float32)).block_until_ready()
    assert n == 1 and len(counter.names) == 2 and all("lambda" in name for name in counter.names)


def test_soak_small(tiny):
    """The in-suite sample: 200 requests, memory sampled every 25 after a warm-up of 50."""
    cfg, params = tiny
    report = soak(200, cfg, params, warmup_requests=50, sample_every=25)
    _print_report(report)
    _check(report)


@pytest.mark.slow
def test_soak_1000(tiny):
    cfg, params = tiny
    report = soak(1000, cfg, params, log=print)
    _print_report(report)
    _check(report)


@pytest.mark.gpu
def test_soak_gpu_2000(tmp_path):
    """2,000 requests on the GPU, the default-size synthetic smoke model (smollm2-135m's shape:
    30 layers, vocabulary 49,152, Q8_0) in bfloat16; prints RSS and device memory samples.
    Greedy agreement with a batch-1 run is reported, not asserted: batch 1 takes other kernels
    (int8 activations) than the 32-slot dispatch, so near-ties may break the other way."""
    import rjax
    from rjax.loading.synth import write_synthetic

    path = write_synthetic(tmp_path / "smoke.gguf", "smollm2-135m", "q8_0", seed=3, tokenizer_from="builtin")
    model = rjax.load(path, progress=False)
    report = soak(2000, model.config, model.params, config=GPU_CONFIG, max_new=32, warmup_requests=200,
                  sample_every=100, log=print)
    _print_report(report)
    assert report["compiles_after_warmup"] == [], report["compiles_after_warmup"]
    assert report["rss_growth"] <= 0.05, report["rss_samples"]
    assert report["device_growth"] is None or report["device_growth"] <= 0.05, report["device_samples"]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="run the soak and print its report")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--smoke-model", action="store_true",
                    help="the default-size synthetic smoke model and the GPU geometry (else the small CPU model)")
    ap.add_argument("--no-solo", action="store_true", help="skip the greedy check against solo runs")
    a = ap.parse_args()
    import tempfile

    import rjax
    from rjax.loading.synth import write_synthetic

    with tempfile.TemporaryDirectory() as d:
        kw = {} if a.smoke_model else dict(n_layers=2, vocab_size=512)
        model = rjax.load(write_synthetic(os.path.join(d, "m.gguf"), "smollm2-135m", "q8_0", seed=3,
                                          tokenizer_from="builtin", **kw), progress=False)
        extra = dict(config=GPU_CONFIG, max_new=32, warmup_requests=200) if a.smoke_model else {}
        _print_report(soak(a.requests, model.config, model.params, check_solo=not a.no_solo, log=print, **extra))
