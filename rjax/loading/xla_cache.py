"""JAX's persistent compilation cache, on by default for rjax in any process.

`rjax.load` calls `use_default_compile_cache`: unless the process has already chosen (a
`jax_compilation_cache_dir` set by the user, by `JAX_COMPILATION_CACHE_DIR` or by an earlier
call, or the cache switched off with `jax_enable_compilation_cache`), compiled programs are kept
in `$RJAX_HOME/xla-cache`, so a new process (a notebook restart, the next script or command) loads
them instead of compiling again. `compile_cache(path)` picks another directory and
`compile_cache(None)` turns the cache off for the process.
"""
from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from rjax.loading.catalog import rjax_home

# JAX keeps only programs that took a second or more to compile. Most of a generate call's
# programs (the sampling step, the cache and its padding, the small jnp ops around them)
# compile in a fraction of that, but there are many of them: kept, a warm start skips them all.
MIN_COMPILE_TIME_S = 0.0


def compile_cache(path: str | os.PathLike | None, *, min_compile_time_s: float = MIN_COMPILE_TIME_S) -> Path | None:
    """Keep compiled XLA programs in the directory `path` across processes; None: compile into
    memory only, for the rest of this process. Programs that compiled faster than
    `min_compile_time_s` are not kept. -> the directory in use, or None."""
    if path is not None and min_compile_time_s < 0:
        raise ValueError(f"compile_cache: min_compile_time_s must be >= 0, got {min_compile_time_s}")
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = Path(path).expanduser()
    if jax.config.jax_compilation_cache_dir not in (None, str(path)):
        compilation_cache.reset_cache()  # JAX opens its cache directory once, at the first compile
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.set_cache_dir(str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    return path


def current_compile_cache() -> Path | None:
    """The directory compiled programs are kept in, or None when they are not kept."""
    d = jax.config.jax_compilation_cache_dir
    return Path(d) if d and jax.config.jax_enable_compilation_cache else None


def use_default_compile_cache(home: str | os.PathLike | None = None) -> Path | None:
    """Turn the cache on in `rjax_home(home)/xla-cache` unless this process has already chosen
    (see the module docstring). -> the directory in use, or None."""
    if jax.config.jax_compilation_cache_dir is not None or not jax.config.jax_enable_compilation_cache:
        return current_compile_cache()
    return compile_cache(rjax_home(home) / "xla-cache")
