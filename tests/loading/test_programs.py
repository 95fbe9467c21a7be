"""rjax.loading.programs: a device program's executable is kept in memory and stored beside the
persistent compilation cache; a later process (here: after jax.clear_caches) runs the stored
one without tracing or compiling, and a stored file that is not what its name promises is
built again with a log line, never run."""
import contextlib
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rjax.loading.programs import device_program
from rjax.loading.xla_cache import compile_cache, current_compile_cache

TRACE = "/jax/core/compile/jaxpr_trace_duration"
COMPILE = "/jax/core/compile/backend_compile_duration"


@device_program(static_argnames=("n",), donate_argnames=("acc",))
def _steps(x, acc, n: int):
    """n rounds of a small recurrence: a program whose result depends on its static argument."""
    def body(i, a):
        return a * 0.5 + jnp.sin(x + i)
    return jax.lax.fori_loop(0, n, body, acc), jnp.sum(x)


def _expected(x, acc, n):
    a = np.asarray(acc, np.float32)
    for i in range(n):
        a = a * np.float32(0.5) + np.sin(np.asarray(x, np.float32) + np.float32(i))
    return a


@contextlib.contextmanager
def _events():
    from jax._src import monitoring

    seen = []

    def listener(event, duration, **kw):
        if event in (TRACE, COMPILE):
            seen.append(event)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def store(tmp_path):
    """A cache directory of this test's own (the run's settings come back after the test)."""
    compile_cache(tmp_path / "xla")
    jax.clear_caches()
    yield tmp_path / "xla" / "programs"
    jax.clear_caches()


def _call(n=3, size=8, events=None):
    """Run `_steps` and check its result; `events`: a list that gets the traces and compiles of
    the call itself (its inputs are made before)."""
    x, acc = jax.block_until_ready((jnp.arange(size, dtype=jnp.float32), jnp.ones(size, jnp.float32)))
    with _events() as seen:
        out, total = _steps(x, acc, n)
    if events is not None:
        events.extend(seen)
    np.testing.assert_allclose(np.asarray(out), _expected(np.arange(size), np.ones(size), n), atol=1e-6)
    assert float(total) == pytest.approx(size * (size - 1) / 2)


def test_a_stored_program_runs_in_a_new_process_without_tracing_or_compiling(store):
    cold, again, warm = [], [], []
    _call(events=cold)
    assert TRACE in cold and COMPILE in cold
    files = list(store.glob("*.bin"))
    assert len(files) == 1 and files[0].name.startswith("_steps-")
    _call(events=again)  # the same process: the executable it holds
    assert again == []
    jax.clear_caches()  # what a new process starts with
    _call(events=warm)
    assert warm == []
    assert _steps.compiled_count() == 1


def test_each_static_value_and_shape_is_a_program_of_its_own(store):
    _call(n=3)
    _call(n=4)
    _call(n=3, size=16)
    assert len(list(store.glob("*.bin"))) == 3 and _steps.compiled_count() == 3


def test_threads_asking_for_one_program_build_it_once(store):
    """The loader's threads ask for the program of one weight type and shape at once: one of
    them builds it, the others wait and run its executable. Here the build is a read from JAX's
    persistent cache (another process compiled it; its stored file is gone), which on the CPU
    is not stored: re-serialized, such an executable failed in the next process ("Function ...
    not found"). Built by several threads at once, the others got it from JAX's memory without
    seeing the cache hit, and stored it."""
    from concurrent.futures import ThreadPoolExecutor

    _call(n=5)
    for f in store.glob("*.bin"):
        f.unlink()
    jax.clear_caches()  # a new process: JAX's persistent cache still holds the compile
    x = jnp.arange(8, dtype=jnp.float32)
    accs = jax.block_until_ready([jnp.ones(8, jnp.float32) for _ in range(8)])  # each call donates its own
    together = threading.Barrier(8)

    def call(acc):
        together.wait()
        return _steps(x, acc, 5)

    with _events() as seen, ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(call, accs))
    for out, total in outs:
        np.testing.assert_allclose(np.asarray(out), _expected(np.arange(8), np.ones(8), 5), atol=1e-6)
    assert seen.count(TRACE) == 1, seen
    assert _steps.compiled_count() == 1
    if jax.default_backend() == "cpu":
        assert list(store.glob("*.bin")) == []


@pytest.mark.parametrize("damage", ["truncated", "flipped", "header", "other key"])
def test_a_damaged_stored_program_is_built_again_with_a_log_line(store, damage, caplog):
    _call(n=3)
    _call(n=5)
    path, other = sorted(store.glob("*.bin"), key=lambda p: p.stat().st_mtime)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":
        path.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    elif damage == "header":
        path.write_bytes(b"NOTAPROG" + data[8:])
    else:  # a whole, valid file under the wrong name: it must not run for this key
        path.write_bytes(other.read_bytes())
    jax.clear_caches()
    events = []
    with caplog.at_level(logging.WARNING, logger="rjax.loading.programs"):
        _call(n=3, events=events)  # checks the result: the right program ran
    assert COMPILE in events and str(path) in caplog.text and "building it again" in caplog.text
    why = {"truncated": "truncated or corrupt", "flipped": "truncated or corrupt", "header": "header differs",
           "other key": "stored for another key"}[damage]
    assert why in caplog.text
    # The damaged file is gone. The rebuilt program came from JAX's persistent cache here, which
    # is not stored again (rjax.loading.programs.compile_lowered): the next process builds it the same way.
    assert not path.exists()
    jax.clear_caches()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rjax.loading.programs"):
        _call(n=3)
    assert caplog.text == ""


def test_calls_under_a_callers_trace_and_without_a_cache_store_nothing(store):
    x = jnp.arange(8, dtype=jnp.float32)
    out = jax.jit(lambda x: _steps(x, jnp.ones(8, jnp.float32), 3)[0])(x)
    np.testing.assert_allclose(np.asarray(out), _expected(np.arange(8), np.ones(8), 3), atol=1e-6)
    assert not store.exists() and _steps.compiled_count() == 0
    compile_cache(None)
    assert current_compile_cache() is None
    _call()
    assert not store.exists() and _steps.compiled_count() == 1


def test_a_static_argument_without_a_stable_text_is_kept_in_memory_only(store):
    class Opaque:  # hashable, but its repr names its address: no key a later process could match
        def __hash__(self):
            return 1

        def __eq__(self, other):
            return isinstance(other, Opaque)

    program = device_program(lambda x, o: x + 1, static_argnames=("o",))
    assert float(program(jnp.float32(1), Opaque())) == 2.0
    assert not store.exists() and program.compiled_count() == 1
