"""The persistent compilation cache is on by default from `rjax.load`, in $RJAX_HOME/xla-cache: a
second fresh process loads every program the first compiled (the engine's stored whole, without
tracing them), and starts faster. A directory the
user chose for JAX, or the cache turned off with `rjax.compile_cache(None)`, is respected.

Each case runs in its own process with a temporary $RJAX_HOME and none of the test run's own
cache settings (conftest.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rjax

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, time
from jax import monitoring

events, traced = {}, []
monitoring.register_event_listener(lambda name, **kw: events.__setitem__(name, events.get(name, 0) + 1))
monitoring.register_event_duration_secs_listener(
    lambda name, secs, fun_name="", **kw: traced.append(fun_name) if name.endswith("jaxpr_trace_duration") else None)
import jax, rjax

if sys.argv[1] == "off":
    rjax.compile_cache(None)
model = rjax.load(sys.argv[2], progress=False)
start = time.perf_counter()
if sys.argv[3] == "generate":
    tokens = rjax.generate(model, "Hi", raw=True, max_new_tokens=4).tokens
else:  # one small program
    tokens = jax.jit(lambda x: x * 2)(jax.numpy.arange(3)).tolist()
first_s = time.perf_counter() - start
count = lambda name: events.get("/jax/compilation_cache/" + name, 0)
print(json.dumps(dict(first_s=first_s, hits=count("cache_hits"), written=count("cache_misses"),
                      traced=traced,
                      dir=str(rjax.loading.xla_cache.current_compile_cache()), tokens=tokens)))
"""


def _run(mode: str, model: Path, home: Path, call: str = "generate", **env) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(model), call], cwd=REPO, capture_output=True, text=True,
                         env={**clean, "RJAX_HOME": str(home), "PYTHONPATH": str(REPO), **env}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _entries(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


@pytest.mark.slow
def test_a_second_process_loads_every_program_from_the_cache(tiny_path, tmp_path):
    home = tmp_path / "home"
    cold = _run("default", tiny_path, home)
    cache = home / "xla-cache"
    assert cold["dir"] == str(cache)
    written = _entries(cache)
    stored = _entries(cache / "programs")
    # Every program is kept, the fast-compiling small ones included; the engine's (the slot batch's
    # start, the prefill and the decode dispatch) and the loader's (a quantized tensor's bytes into
    # its planes) are also stored whole (rjax.loading.programs), and run from there without tracing.
    assert cold["hits"] == 0 and cold["written"] >= 3 and len(written - {"programs"}) >= cold["written"]
    assert {name.split("-")[0] for name in stored} == {"init_slots", "prefill_into_slots", "decode_dispatch",
                                                            "planes_from_bytes"}
    warm = _run("default", tiny_path, home)
    assert warm["tokens"] == cold["tokens"]
    assert (warm["hits"], warm["written"]) == (cold["written"] - len(stored), 0)
    assert _entries(cache) == written and _entries(cache / "programs") == stored
    engine = {"prefill_into_slots", "decode_dispatch"}
    assert engine <= set(cold["traced"]) and not engine & set(warm["traced"])
    assert warm["first_s"] < cold["first_s"], (cold, warm)


@pytest.mark.slow
def test_the_users_choice_is_respected(tiny_path, tmp_path):
    mine = tmp_path / "mine"
    chosen = _run("default", tiny_path, tmp_path / "a", "jit", JAX_COMPILATION_CACHE_DIR=str(mine),
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert chosen["dir"] == str(mine) and chosen["written"] > 0 and _entries(mine)
    assert not (tmp_path / "a" / "xla-cache").exists()
    off = _run("off", tiny_path, tmp_path / "b", "jit")
    assert off["dir"] == "None" and off["written"] == off["hits"] == 0
    assert not (tmp_path / "b" / "xla-cache").exists()


def test_the_test_runs_cache_stays(tmp_path):
    # conftest.py set this run's cache directory through JAX's own setting: rjax.load keeps it.
    assert rjax.loading.xla_cache.use_default_compile_cache(tmp_path) == Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    assert not (tmp_path / "xla-cache").exists()


def test_compile_cache_checks_its_argument(tmp_path):
    with pytest.raises(ValueError, match="min_compile_time_s must be >= 0"):
        rjax.compile_cache(tmp_path, min_compile_time_s=-1)
