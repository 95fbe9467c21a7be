"""rjax.engine.precompile: programs compiled ahead, concurrently, are the ones the engine's calls then
run (no XLA compile at call time), with the same results as compiling at the call."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rjax.cli.bench import load_for_bench
from rjax.engine import steps as engine
from rjax.engine.precompile import BackgroundCompile, Program, compile_programs, decode_program, prefill_program
from rjax.loading.programs import device_program
from rjax.loading.synth import write_synthetic
from rjax.loading.xla_cache import compile_cache
from rjax.math.cache import init_cache
from rjax.math.sampling import SamplingParams
from rjax.runtime.serving import ServingConfig, ServingEngine

B, BUCKET, CACHE, STEPS = 2, 16, 64, 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("precompile") / "tiny.gguf", "smollm2-135m", "q4_1",
                           n_layers=2, vocab_size=512, tokenizer_from="builtin")
    cfg, params, _ = load_for_bench(path, progress=False)
    return cfg, params


@contextlib.contextmanager
def count_compiles():
    """The functions XLA compiled inside the block, by name, as JAX reports them."""
    from jax._src import monitoring
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    seen = []

    def listener(event, duration, fun_name="", **kw):
        if event == BACKEND_COMPILE_EVENT:
            seen.append(fun_name)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(listener)


def _run(cfg, params):
    """A prefill and one decode dispatch with real arrays, as rjax.runtime.generation makes them."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, BUCKET)), jnp.int32)
    lengths = jnp.asarray([BUCKET, 9], jnp.int32)
    key = jax.random.key(3)
    sp = SamplingParams.make(B)
    stop_ids = jnp.asarray([-1], jnp.int32)
    cache = init_cache(cfg, B, CACHE, jnp.float32)
    jax.block_until_ready((tokens, lengths, key, sp, stop_ids, cache))
    with count_compiles() as compiles:
        first, cache = engine.prefill_and_sample(cfg, params, cache, tokens, lengths, None, key, sp)
        state = engine.initial_state(first, jnp.full((B,), 8, jnp.int32), stop_ids, key, cache)
        jax.block_until_ready(state)
        n_before = len(compiles)
        out, state, cache = engine.decode_loop(cfg, params, cache, state, sp, stop_ids, STEPS)
        out = np.asarray(out)
    return np.asarray(first), out, compiles[:n_before], compiles[n_before:]


def test_precompiled_calls_compile_nothing_and_match(model):
    cfg, params = model
    compile_cache(None)  # nothing stored: every program here is compiled (tests/loading/test_programs.py)
    jax.clear_caches()
    cold_first, cold_out, cold_prefill, cold_decode = _run(cfg, params)
    assert cold_prefill and cold_decode, "without precompiling, the calls compile their programs"

    jax.clear_caches()
    programs = [prefill_program(cfg, params, B, BUCKET, CACHE, jnp.float32),
                decode_program(cfg, params, B, CACHE, jnp.float32, STEPS)]
    with count_compiles() as compiles:
        report = compile_programs(programs, workers=2)
    assert len(compiles) >= 2
    assert set(report.compile_s) == {"prefill B=2 T=16", "decode B=2 N=3"}
    assert report.workers == 2 and report.total_s == pytest.approx(report.lower_s + report.wall_s)
    assert report.wall_s <= sum(report.compile_s.values()) + 1.0

    assert {"jit(prefill_and_sample)", "jit(decode_loop)"} <= set(cold_prefill + cold_decode)
    assert {"jit(prefill_and_sample)", "jit(decode_loop)"} <= set(compiles)

    first, out, prefill_compiles, decode_compiles = _run(cfg, params)
    # initial_state's few small ops may compile; the two engine programs must not.
    assert "jit(prefill_and_sample)" not in prefill_compiles and not decode_compiles
    np.testing.assert_array_equal(first, cold_first)
    np.testing.assert_array_equal(out, cold_out)
    assert (out >= 0).all()


def test_bad_program_names_itself(model):
    cfg, params = model
    good = decode_program(cfg, params, B, CACHE, jnp.float32, STEPS)
    bad = Program("decode with a wrong cache", good.fn, (cfg, params, "not a cache") + good.args[3:])
    with pytest.raises(RuntimeError, match="decode with a wrong cache"):
        compile_programs([bad])
    report = compile_programs([good, bad], on_error="record")
    assert set(report.compiled) == {good.name} and set(report.errors) == {bad.name}
    assert "lowering decode with a wrong cache failed" in report.errors[bad.name]
    with pytest.raises(ValueError, match="unique"):
        compile_programs([good, good])
    with pytest.raises(ValueError, match="bucket 17"):
        prefill_program(cfg, params, B, 17, CACHE, jnp.float32)


def test_generation_compiles_each_program_once_ahead(model, tmp_path):
    import rjax
    from rjax.runtime.generation import stream_ids

    path = write_synthetic(tmp_path / "tiny.gguf", "smollm2-135m", "q4_1", n_layers=2, vocab_size=512,
                           tokenizer_from="builtin")
    m = rjax.load(path, progress=False)
    compile_cache(tmp_path / "xla")  # nothing stored yet
    jax.clear_caches()
    stats: dict = {}
    with count_compiles() as compiles:
        steps = list(stream_ids(m, [[1, 2, 3, 4, 5]], max_new_tokens=6, steps_per_dispatch=2, stats=stats))
    # The server's slot programs, a batch of one row, each compiled once.
    assert compiles.count("jit(prefill_into_slots)") == 1 and compiles.count("jit(decode_dispatch)") == 1
    assert not {"jit(prefill_and_sample)", "jit(decode_loop)", "jit(greedy_decode_loop)"} & set(compiles)
    assert stats["compile_s"] > 0 and sum(len(s[0]) for s in steps) == 6


@pytest.mark.parametrize("page_size", [16, None])
def test_serving_engine_precompiles_every_shape_it_calls(model, page_size):
    cfg, params = model
    config = ServingConfig(n_slots=3, max_len=64, page_size=page_size, steps_per_dispatch=4,
                           prefill_buckets=(1, 2), max_prefill_tokens=64)
    eng = ServingEngine(cfg, params, config)
    # One prompt of any bucketed length up to 63 tokens; two only while 2 x bucket <= 64.
    assert eng.prefill_shapes() == [(1, 16), (1, 32), (1, 64), (2, 16), (2, 32)]
    assert eng.prefill_shapes([5, 40]) == [(1, 16), (1, 64), (2, 16)]
    jax.clear_caches()
    report = eng.precompile()
    # A paged engine decodes the running slots padded to 1 or 3 (config.decode_buckets).
    decode = ["decode B=1 N=4", "decode B=3 N=4"] if page_size else ["decode B=3 N=4"]
    # The programs for batches of greedy requests alone, and of sampled ones without top-k / top-p.
    decode += [f"{name} {variant}" for name in decode for variant in ("greedy", "unfiltered")]
    # And the variant with logit adjustments and masks, of 4 steps and of 1 (constrained requests).
    batches = (1, 3) if page_size else (3,)
    decode += [f"decode B={b} N={n} adjusted" for b in batches for n in (1, 4)]
    assert sorted(report.compile_s) == sorted(decode + [f"prefill P={p} T={t}" for p, t in eng.prefill_shapes()])
    rng = np.random.default_rng(1)
    lengths = [5, 20, 40, 3, 60, 11]  # singles and pairs over the 16, 32 and 64 buckets
    with count_compiles() as compiles:
        ids = [eng.submit(list(rng.integers(0, cfg.vocab_size, n)), max_new_tokens=3) for n in lengths]
        done = {e.request_id: e.completion for e in eng.run() if e.finished}
    assert sorted(done) == sorted(ids) and all(len(done[i].tokens) == 3 for i in ids)
    assert "jit(prefill_into_slots)" not in compiles and "jit(decode_dispatch)" not in compiles


def test_compiled_programs_are_remembered_until_jax_clears_its_caches(model, tmp_path):
    """A program compiled once is not lowered again (rjax.generate asks for its programs on every
    call); after jax.clear_caches() it is read back from the store, or built again without one."""
    cfg, params = model
    compile_cache(tmp_path / "xla")  # nothing stored yet
    program = decode_program(cfg, params, B, CACHE, jnp.float32, STEPS)
    jax.clear_caches()
    first = compile_programs([program])
    with count_compiles() as compiles:
        again = compile_programs([decode_program(cfg, params, B, CACHE, jnp.float32, STEPS)])
    assert not compiles and again.lowered_s[program.name] == 0.0
    assert again.compiled[program.name] is first.compiled[program.name]
    jax.clear_caches()  # then it is read back from the store, neither lowered nor compiled
    with count_compiles() as compiles:
        stored = compile_programs([program])
    assert not compiles and stored.compiled[program.name] is not first.compiled[program.name]
    compile_cache(None)  # nothing stored: built again
    jax.clear_caches()
    with count_compiles() as compiles:
        compile_programs([program])
    assert "jit(decode_loop)" in compiles


def test_serving_engine_serves_its_first_programs_while_the_rest_compile(model, caplog):
    """precompile_first builds what a first ordinary request needs; until the rest are built, a
    call runs in a larger built program (the log says which) or compiles its own, and every
    request gets the tokens of an engine that compiled everything ahead."""
    cfg, params = model
    config = ServingConfig(n_slots=3, max_len=64, page_size=16, steps_per_dispatch=4, prefill_buckets=(1, 2),
                           max_prefill_tokens=64)
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (5, 40)]

    def serve(eng, prompt, **kw):
        rid = eng.submit(prompt, max_new_tokens=5, **kw)
        return next(e.completion.tokens for e in eng.run() if e.finished and e.request_id == rid)

    at_call = ServingEngine(cfg, params, config)  # compiles each program as it first calls it
    want = [serve(at_call, p) for p in prompts] + [serve(at_call, prompts[0], temperature=0.8, top_k=5, seed=7)]

    # The engine's own account of what is built decides, whatever JAX's caches already hold; with
    # no background worker nothing else gets built, so the choices below are certain.
    eng = ServingEngine(cfg, params, config)
    report = eng.precompile_first(first_tokens=64, background_workers=0)
    assert sorted(report.compile_s) == ["decode B=1 N=4 greedy", "decode B=1 N=4 unfiltered", "prefill P=1 T=64"]
    every = {p.name for p in eng.runner.programs.programs().values()}
    assert sorted(eng.compiling) == sorted(every - set(report.compile_s)) and "prefill P=2 T=32" in every
    with caplog.at_level("INFO", logger="rjax.runtime.serving"):
        got = [serve(eng, p) for p in prompts] + [serve(eng, prompts[0], temperature=0.8, top_k=5, seed=7)]
    assert got == want
    # 5 tokens: the T=64 program, padded further; 40 tokens: its own
    assert "a prefill of 1 prompt(s) of up to 16 tokens runs in prefill P=1 T=64 while prefill P=1 T=16 " \
        "compiles" in caplog.text and "up to 64 tokens" not in caplog.text
    # top-k: no built program filters, so it waits for (here: compiles) its own, which is then built
    assert caplog.text.count("a decode dispatch of 1 row(s) waited") == 1 and "for decode B=1 N=4 to compile" \
        in caplog.text and "decode B=1 N=4" not in eng.compiling and "prefill P=1 T=16" in eng.compiling


def test_background_compile_builds_every_program_and_a_waited_one_first():
    """Programs build in a background thread; `wait` returns once its program is built (moved to
    the front of the queue), and the calls then compile nothing."""
    fns = [device_program(lambda x, k=k: jnp.sin(x) * k) for k in range(4)]
    args = [(jax.ShapeDtypeStruct((3 + k,), jnp.float32),) for k in range(4)]
    programs = [Program(f"p{k}", fn, a) for k, (fn, a) in enumerate(zip(fns, args))]
    bg = BackgroundCompile(programs, workers=1)
    bg.wait("p3")
    assert bg.is_built("p3") and "p3" in bg.compile_s and bg.is_built("not mine")
    bg.join()
    assert bg.pending == [] and bg.errors == {} and sorted(bg.compile_s) == ["p0", "p1", "p2", "p3"]
    xs = jax.block_until_ready([jnp.ones(3 + k) for k in range(4)])
    with count_compiles() as compiles:
        got = [np.asarray(fn(x)) for fn, x in zip(fns, xs)]
    assert not compiles and all(np.allclose(g, np.sin(1.0) * k) for k, g in enumerate(got))
