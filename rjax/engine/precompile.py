"""Compile the XLA programs a workload will call before it calls them, several at a time.

XLA compiles a program mostly on one CPU core (the Pallas kernels go through Triton one after
another inside it), and its time hardly depends on the number of layers: it is the kernels
and fusions of distinct shapes that cost. The engine's programs for a set of batch sizes,
prompt buckets and steps per dispatch are independent of each other, and XLA releases the
GIL while it compiles, so compiling them in threads cuts the wait from their sum to about the
slowest one (docs/architecture.md, "Engine"). Each program starts compiling as soon as it is
lowered, while the next one lowers (lowering is Python, one program at a time).

Programs are lowered from abstract arguments (shapes and dtypes: no cache is allocated)
through the same device programs (rjax.loading.programs) the engine calls, which keep the executables:
the later calls with real arrays run them, and a later process loads them from the store
without lowering them again.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from rjax.engine import steps, slots
from rjax.loading.programs import DeviceProgram
from rjax.math.cache import init_cache
from rjax.math.config import ModelConfig
from rjax.math.params import Params
from rjax.math.plan import TUNING
from rjax.math.sampling import MAX_LOGIT_BIAS, LogitAdjust, SamplingParams
from rjax.math.tensor_parallel import abstract_cache


@dataclasses.dataclass(frozen=True)
class Program:
    """One call of a device program (rjax.loading.programs) of the engine, by the shapes of its arguments."""

    name: str
    fn: DeviceProgram
    args: tuple           # arrays, or jax.ShapeDtypeStruct trees standing for them

    def lower(self):
        return self.fn.lower(*self.args)


def _abstract(make: Callable[[], Any]):
    return jax.eval_shape(make)


def prefill_program(cfg: ModelConfig, params: Params, batch: int, bucket: int, cache_len: int, dtype,
                    with_slots: bool = False, kv_dtype: str | None = None) -> Program:
    """`steps.prefill_and_sample` for `batch` prompts padded to `bucket` tokens into a cache of
    `cache_len` positions (`with_slots`: into given cache rows, as the server does), K/V stored
    as `kv_dtype` (rjax.math.cache.init_cache)."""
    if bucket not in steps.PROMPT_BUCKETS:
        raise ValueError(f"prompt bucket {bucket} is not one of engine.PROMPT_BUCKETS")
    cache = abstract_cache(_abstract(lambda: init_cache(cfg, batch, cache_len, dtype, kv_dtype)), params.tp)
    tokens = jax.ShapeDtypeStruct((batch, bucket), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    slots = jax.ShapeDtypeStruct((batch,), jnp.int32) if with_slots else None
    key = _abstract(lambda: jax.random.key(0))
    sp = _abstract(lambda: SamplingParams.make(batch))
    return Program(f"prefill B={batch} T={bucket}", steps.prefill_and_sample,
                   (cfg, params, cache, tokens, lengths, slots, key, sp))


def decode_program(cfg: ModelConfig, params: Params, batch: int, cache_len: int, dtype, n_steps: int,
                   n_stop_ids: int = 1, kv_dtype: str | None = None, greedy: bool = False,
                   filters: bool = True) -> Program:
    """`steps.decode_loop` (`greedy`: `steps.greedy_decode_loop`) of `n_steps` steps over
    `batch` slots of a `cache_len` cache (K/V stored as `kv_dtype`), with a stop set of
    `n_stop_ids` token ids. filters=False: the loop without top-k / top-p, called as
    `decode_loop(..., n_steps, TUNING, False)`."""
    cache = abstract_cache(_abstract(lambda: init_cache(cfg, batch, cache_len, dtype, kv_dtype)), params.tp)
    stop_ids = jax.ShapeDtypeStruct((n_stop_ids,), jnp.int32)
    state = _abstract(lambda: steps.initial_state(jnp.zeros((batch,), jnp.int32), 1, jnp.full((n_stop_ids,), -1),
                                                   jax.random.key(0), init_cache(cfg, batch, cache_len, dtype,
                                                                                 kv_dtype)))
    sp = _abstract(lambda: SamplingParams.make(batch))
    if greedy:
        return Program(f"decode B={batch} N={n_steps}", steps.greedy_decode_loop,
                       (cfg, params, cache, state, sp, stop_ids, n_steps))
    extra = () if filters else (TUNING, False)
    return Program(f"decode B={batch} N={n_steps}" + ("" if filters else " unfiltered"), steps.decode_loop,
                   (cfg, params, cache, state, sp, stop_ids, n_steps) + extra)


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def prefill_into_slots_program(cfg: ModelConfig, params: Params, cache, batch, prompts: int, bucket: int) -> Program:
    """`slots.prefill_into_slots` of `prompts` prompts padded to `bucket` tokens into `cache`
    (contiguous or paged) and the slot batch `batch` (arrays, or shapes standing for them)."""
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    p = prompts
    return Program(f"prefill P={p} T={bucket}", slots.prefill_into_slots, (
        cfg, params, cache, batch, _i32(p, bucket), _i32(p), _i32(p), jax.ShapeDtypeStruct((p,), jnp.bool_),
        jax.ShapeDtypeStruct((p, 2), jnp.uint32), jax.ShapeDtypeStruct((p,), jnp.uint32),
        SamplingParams(f32(p), _i32(p), f32(p)), _i32(p), _i32(p, batch.stop_ids.shape[1]),
        LogitAdjust(f32(p), f32(p), f32(p), f32(p), _i32(p, MAX_LOGIT_BIAS), f32(p, MAX_LOGIT_BIAS)),
        _i32(p, batch.mask.shape[1])))


def decode_dispatch_program(cfg: ModelConfig, params: Params, cache, batch, n_steps: int, logprobs: bool = False,
                            rows: int | None = None, greedy: bool = False, filters: bool = True,
                            adjust: bool = False) -> Program:
    """`slots.decode_dispatch` of `n_steps` steps over `cache` and the slot batch `batch`
    (rows: a paged cache's batch of that many rows, else every row), called positionally."""
    variant = "".join(name for on, name in ((logprobs, " logprobs"), (greedy, " greedy"), (not filters, " unfiltered"),
                                            (adjust, " adjusted")) if on)
    B = batch.state.last_token.shape[0] if rows is None else rows
    return Program(f"decode B={B} N={n_steps}{variant}", slots.decode_dispatch,
                   (cfg, params, cache, batch, n_steps, logprobs, None if rows is None else _i32(rows), greedy,
                    filters, adjust))


@dataclasses.dataclass(frozen=True)
class CompileReport:
    workers: int
    lower_s: float                  # tracing and lowering, one program after another (Python),
                                    # while the programs lowered so far compile
    wall_s: float                   # from the last lowering until every program is compiled
    lowered_s: dict[str, float]     # each program's own lowering time
    compile_s: dict[str, float]     # each program's own compile time
    compiled: dict[str, Any]        # the executables (jax.stages.Compiled), by program name
    errors: dict[str, str]          # with on_error="record": what failed, by program name

    @property
    def total_s(self) -> float:
        return self.lower_s + self.wall_s


def compile_programs(programs: Sequence[Program], workers: int | None = None, progress: bool = False,
                     on_error: str = "raise") -> CompileReport:
    """Lower the programs one by one, each compiled in one of `workers` threads (default: one
    per program, up to the CPU count) as soon as it is lowered. A failure names the program;
    on_error="record" notes it in `errors` and goes on with the others."""
    from tqdm.auto import tqdm

    if on_error not in ("raise", "record"):
        raise ValueError(f"on_error must be 'raise' or 'record', got {on_error!r}")
    if len({p.name for p in programs}) != len(programs):
        raise ValueError(f"program names must be unique: {[p.name for p in programs]}")
    if workers is None:
        workers = min(len(programs), os.cpu_count() or 1)
    workers = max(1, min(workers, len(programs) or 1))
    errors: dict[str, str] = {}

    def failed(what: str, name: str, e: Exception):
        msg = f"{what} {name} failed: {type(e).__name__}: {e}"
        if on_error == "raise":
            raise RuntimeError(msg) from e
        errors[name] = msg

    def compile_one(p: Program, call, lo):
        t = time.perf_counter()
        try:  # kept (and stored) in this thread too: serializing a large program takes a while
            return p.name, p.fn.build(call, lo), time.perf_counter() - t, None
        except Exception as e:  # raised in this thread, reported in the caller's
            return p.name, None, time.perf_counter() - t, e

    # Each program starts compiling as soon as it is lowered, while the next one lowers (XLA
    # releases the GIL): the wait is the lowering plus about the last compile, not their sum.
    t0 = time.perf_counter()
    # The bar shows only once a program must be built: programs this process has compiled
    # already are found without a flicker on the terminal.
    bar = None
    lowered_s: dict[str, float] = {}
    times: dict[str, float] = {}
    compiled: dict[str, Any] = {}
    pool = ThreadPoolExecutor(workers)
    try:
        futures = []
        for p in programs:
            try:
                call = p.fn.bind(*p.args, check=False)
                exe = p.fn.load(call)  # built by this process, or stored
            except Exception as e:
                failed("lowering", p.name, e)
                continue
            if exe is not None:
                lowered_s[p.name], times[p.name], compiled[p.name] = 0.0, 0.0, exe
                continue
            if bar is None:
                bar = tqdm(total=len(programs), initial=len(compiled), desc="compiling", unit="program",
                           disable=not progress, leave=False)
            t = time.perf_counter()
            try:
                lo = p.fn.lowered(call)
            except Exception as e:
                failed("lowering", p.name, e)
                continue
            finally:
                lowered_s[p.name] = time.perf_counter() - t
            futures.append(pool.submit(compile_one, p, call, lo))
        lower_end = time.perf_counter()
        for f in futures:
            name, exe, dt, err = f.result()
            bar.update()
            if err is not None:
                failed("compiling", name, err)
                continue
            times[name], compiled[name] = dt, exe
    finally:  # on a failure: return now, leaving compiles already running to finish on their own
        pool.shutdown(wait=False, cancel_futures=True)
        if bar is not None:
            bar.close()
    lower_s = lower_end - t0
    return CompileReport(workers, lower_s, time.perf_counter() - lower_end, lowered_s, times, compiled, errors)


class BackgroundCompile:
    """Compiles programs in `workers` background threads, in order, while the caller goes on (a
    server answering its first requests): each thread lowers the next program and compiles it
    (workers=0: none does, and each program is its caller's to compile when first needed).
    `wait(name)` moves a program not yet started to the front and blocks until it is built.
    `pending` names the programs not yet built (a server's /health and /metrics show them)."""

    def __init__(self, programs: Sequence[Program], workers: int = 1):
        self._queue = collections.deque(programs)
        self._built = {p.name: threading.Event() for p in programs}
        self._started: set[str] = set()
        self._lock = threading.Lock()
        self.errors: dict[str, str] = {}
        self.compile_s: dict[str, float] = {}
        self._threads = [threading.Thread(target=self._work, name=f"rjax-compile-{i}", daemon=True)
                         for i in range(min(workers, len(programs)))]
        for t in self._threads:
            t.start()

    @property
    def pending(self) -> list[str]:
        return [name for name, built in self._built.items() if not built.is_set()]

    def is_built(self, name: str) -> bool:
        """Whether `name` is built (or was never this compiler's to build)."""
        built = self._built.get(name)
        return built is None or built.is_set()

    def wait(self, name: str) -> None:
        """Block until program `name` is built (or failed, see `errors`), compiling it next if no
        thread has started it. A program no thread will start (after `cancel`, or with no
        workers) is the caller's to compile: it counts as built from then on, and this returns
        at once."""
        built = self._built.get(name)
        if built is None or built.is_set():
            return
        with self._lock:
            queued = next((p for p in self._queue if p.name == name), None)
            if queued is not None:
                self._queue.remove(queued)
                if self._threads:
                    self._queue.appendleft(queued)
            if name not in self._started and (queued is None or not self._threads):
                built.set()
        built.wait()

    def cancel(self) -> None:
        """Start no more programs (those compiling finish)."""
        with self._lock:
            self._queue.clear()

    def join(self, timeout: float | None = None) -> None:
        for t in self._threads:
            t.join(timeout)

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                p = self._queue.popleft()
                self._started.add(p.name)
            t = time.perf_counter()
            report = compile_programs([p], workers=1, on_error="record")
            self.compile_s[p.name] = time.perf_counter() - t
            self.errors.update(report.errors)
            self._built[p.name].set()
