"""Shared fixtures: the real catalog models (pulled into the cache on first use) and the oracle."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Under pytest-xdist several test processes share one GPU: each takes device memory as it
# needs it rather than XLA's default share up front.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # lets tests import `tests.oracle.client`
    sys.path.insert(0, str(REPO))


def pytest_configure(config):
    # Tests compile into memory only: an in-process `rjax.cli.main` (the CLI tests) would switch
    # its test process to the persistent compilation cache in $RJAX_HOME, shared with the user's
    # runs and with the other test processes.
    import jax

    jax.config.update("jax_enable_compilation_cache", False)


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


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from rjax.catalog import resolve_model

    return Path(resolve_model("smollm2-135m-instruct", progress=False))


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from rjax.catalog import resolve_model

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
    from rjax.synth import write_synthetic

    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    return write_synthetic(path, "smollm2-135m", "q8_0", seed=3, n_layers=2, vocab_size=512,
                           tokenizer_from="builtin")


@pytest.fixture(scope="module")
def tiny(tiny_path):
    """(config, params) of `tiny_path`."""
    from rjax.loaders.gguf import load_gguf

    cfg, params, _ = load_gguf(tiny_path, progress=False)
    return cfg, params
