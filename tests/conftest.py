"""Shared fixtures: the real catalog models (pulled into the cache on first use) and the oracle."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Under pytest-xdist several test processes share one GPU: each takes device memory as it
# needs it rather than XLA's default share up front.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # lets tests import `tests.oracle.client`
    sys.path.insert(0, str(REPO))


# The persistent compilation cache of one test run, as JAX's own settings: the controller
# creates it, and the pytest-xdist workers and the notebook kernels inherit it through the
# environment (a CLI command run as a subprocess keeps its own $RJAX_HOME/xla-cache).
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_CACHE_SETTINGS = {
    "jax_enable_compilation_cache": True,
    # Every program, however fast to compile: on the CPU a cached executable loads in about an
    # eighth of its compile time.
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}


def pytest_configure(config):
    """Share compiled programs between test modules and workers, through a persistent
    compilation cache in a directory of this run's own (never the user's $RJAX_HOME, removed
    at the end). `_release_compiled_programs` empties the in-memory caches after every module,
    so without it each module would compile the same programs again."""
    import jax

    if not hasattr(config, "workerinput"):  # the controller, or a run without pytest-xdist
        config._rjax_xla_cache = tempfile.mkdtemp(prefix="rjax-test-xla-cache-")
        os.environ[_CACHE_ENV] = config._rjax_xla_cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    _CACHE_SETTINGS["jax_compilation_cache_dir"] = os.environ[_CACHE_ENV]
    for name, value in _CACHE_SETTINGS.items():
        jax.config.update(name, value)
    # JAX opens the cache directory at its first compile and keeps it for the process: compile
    # now, so that a test that points the setting elsewhere (`rjax.cli.main.main` sets
    # $RJAX_HOME/xla-cache) cannot move this process's cache.
    jax.jit(lambda x: x + 1)(0)


def pytest_unconfigure(config):
    cache = getattr(config, "_rjax_xla_cache", None)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def _keep_compilation_cache_settings():
    """Put back the run's cache settings after a test changed them (`rjax.cli.main.main` and
    `rjax bench` set their own when called in-process), and reopen the run's cache directory
    if the test may have moved it."""
    yield
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    changed = {name: value for name, value in _CACHE_SETTINGS.items() if getattr(jax.config, name) != value}
    for name, value in changed.items():
        jax.config.update(name, value)
    if {"jax_compilation_cache_dir", "jax_enable_compilation_cache"} & set(changed):
        compilation_cache.reset_cache()  # reopened at the next compile, from the settings above


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module. Every CPU executable keeps its
    machine code in memory mappings of its own (three per compiled kernel), and one module
    leaves about 12,000 of them; a pytest-xdist worker that ran half the suite passed Linux's
    vm.max_map_count (65,530) and crashed inside the XLA compiler (SIGSEGV or SIGABRT in
    backend_compile). Clearing the caches unmaps them once the module's fixtures are gone."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
    import jax

    if jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    # Modules that hold a slow test run first, each still whole (its module-scoped fixtures set
    # up once): pytest-xdist then starts the long work early, and the run ends on short tests
    # that an idle worker can take over.
    slow = {item.path for item in items if "slow" in item.keywords and not item.get_closest_marker("skip")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from rjax.loading.catalog import resolve_model

    return Path(resolve_model("smollm2-135m-instruct", progress=False))


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from rjax.loading.catalog import resolve_model

    return Path(resolve_model("gemma3-270m", progress=False))


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The default model, loaded once per test session (worker)."""
    import rjax

    return rjax.load(smollm2_path, progress=False)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    """A small synthetic llama GGUF (2 layers of the default model's shape, vocabulary 512,
    a built-in byte-level tokenizer): fast to load and compile."""
    from rjax.loading.synth import write_synthetic

    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    return write_synthetic(path, "smollm2-135m", "q8_0", seed=3, n_layers=2, vocab_size=512,
                           tokenizer_from="builtin")


@pytest.fixture(scope="module", params=["mixtral", "qwen3moe"])
def tiny_moe_path(request, tmp_path_factory) -> Path:
    """A small synthetic mixture of experts of each architecture, 8 experts of which 2 per token,
    one layer: Mixtral's (GGUF `llama` with experts; Q5_0 and Q8_0 blocks, as the q4_k mix falls
    back on 64-wide rows) and Qwen3-MoE's (q/k norms, head dim 32, Q8_0)."""
    from rjax.loading.synth import Shape, write_synthetic

    shape, quant = {
        "mixtral": (Shape("tiny-mixtral", "llama", 1, 64, 64, 4, 2, 512, 256, 10000.0, 1e-5, tied_embeddings=False,
                          n_experts=8, n_experts_used=2, expert_d_ff=64), "q4_k"),
        "qwen3moe": (Shape("tiny-qwen3moe", "qwen3moe", 1, 64, 96, 4, 2, 512, 256, 1e6, 1e-6, head_dim=32,
                           tied_embeddings=False, n_experts=8, n_experts_used=2, expert_d_ff=32), "q8_0"),
    }[request.param]
    path = tmp_path_factory.mktemp("synth") / f"{shape.name}.gguf"
    return write_synthetic(path, shape, quant, seed=7, tokenizer_from="builtin")


@pytest.fixture(scope="module")
def tiny(tiny_path):
    """(config, params) of `tiny_path`."""
    from rjax.loading.loaders.gguf import load_gguf

    cfg, params, _ = load_gguf(tiny_path, progress=False)
    return cfg, params
