"""Start-up: wall time from process start to the first token and to a healthy server, cold and warm.

    python benchmarks/startup.py                    # default model, all three, medians of 3
    python benchmarks/startup.py --model llama-1b-q4_k.gguf --raw --json --out startup.json

Measured, each in a fresh process with its own $RJAX_HOME (the catalog's models linked in, so
nothing is downloaded):
- `generate`: `rjax generate --max-new-tokens N "Hi"`, until its first reply byte on stdout;
- `api`: `import rjax; rjax.load(...); rjax.stream(...)` in a fresh Python (`rjax.load` turns
  the persistent compilation cache on), until its first chunk; `after_load_s` is
  the notebook's wait: from `rjax.load` returning to the first chunk;
- `serve`: `rjax serve`, until `/health` answers 200.
Cold: an empty compile cache (a new $RJAX_HOME per run). Warm: the cache the cold runs left.

Each child runs under this script (`--child`), which listens to JAX's monitoring events and
writes them with their times, so every row breaks down into: Python start and imports, model
load (and within it: the header, the weights to the device, the tokenizer, fusing projections,
the GPU layout), tracing, lowering to MLIR, XLA compile (persistent-cache reads included),
reading stored programs, cache hits and misses, programs built, and the rest (the first calls
themselves, host work).
Tracing, lowering and compiling are sums over programs; compiles run in threads beside the
lowering of the next program (rjax.engine.precompile), so their sum can exceed the time they took.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHATS = ("generate", "api", "serve")

# JAX's monitoring events (jax/_src/dispatch.py, compiler.py, compilation_cache.py).
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE = "/jax/core/compile/backend_compile_duration"  # XLA compile, or a persistent-cache read
CACHE_READ = "/jax/compilation_cache/cache_retrieval_time_sec"
HIT = "/jax/compilation_cache/cache_hits"
MISS = "/jax/compilation_cache/cache_misses"

# The model load and the stored programs, broken down by the functions that do them: (column,
# module, attribute). Each is timed from its call until its result is on the device (the
# breakdown waits for it there, which a plain run would do at its first call anyway).
SPANS = (("header_s", "rjax.loading.loaders.gguf", "open_gguf"),
         ("header_s", "rjax.loading.loaders.gguf", "config_from_reader"),
         ("weights_s", "rjax.loading.loaders.gguf", "load_params"),
         ("tokenizer_s", "rjax.loading.tokenizer", "Tokenizer.from_gguf"),
         ("fuse_s", "rjax.math.layout", "fuse_projections"), ("layout_s", "rjax.math.layout", "gpu_weight_layout"),
         ("program_read_s", "rjax.loading.programs", "_load"))


# -- the child: one measured process ----------------------------------------------------------------

def _child(what: str, model: str, max_new_tokens: int, port: int, record: str, raw: bool) -> int:
    t0 = float(os.environ["RJAX_STARTUP_T0"])  # the parent's clock when it started this process
    events: list = []
    marks: dict[str, float] = {}
    now = lambda: time.time() - t0  # noqa: E731

    def save():
        Path(record).write_text(json.dumps({"events": events, "marks": marks}))

    atexit.register(save)
    # uvicorn exits cleanly on SIGINT/SIGTERM; a plain child turns SIGTERM into an exit that runs atexit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    import jax
    from jax import monitoring

    monitoring.register_event_listener(lambda event, **kw: events.append((event, 0.0, now(), "")))
    monitoring.register_event_duration_secs_listener(
        lambda event, d, **kw: events.append((event, d, now(), str(kw.get("fun_name", "")))))
    import rjax
    import rjax.cli.main  # noqa: F401
    marks["import"] = now()
    spans: list = []
    marks["spans"] = spans
    _time_spans(spans, now)
    load = rjax.load

    def timed_load(*a, **kw):
        m = load(*a, **kw)
        marks["load"] = now()
        return m

    rjax.load = timed_load
    if what == "generate":
        return rjax.cli.main.main(["generate", "-m", model, "--max-new-tokens", str(max_new_tokens), "Hi"]
                             + ["--raw"] * raw)
    if what == "serve":
        return rjax.cli.main.main(["serve", "-m", model, "--port", str(port)])
    m = rjax.load(model, progress=False)  # which turns the persistent cache on (rjax.loading.xla_cache)
    for chunk in rjax.stream(m, "Hi", max_new_tokens=max_new_tokens, raw=raw):
        marks.setdefault("first_token", now())
        sys.stdout.write(chunk)
        sys.stdout.flush()
    marks["done"] = now()
    return 0


def _time_spans(spans: list, now) -> None:
    """Wrap each function of SPANS so that its calls land in `spans` as (column, start, end)."""
    import importlib

    import jax

    for column, module, attribute in SPANS:
        owner = importlib.import_module(module)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        fun = owner.__dict__.get(name)
        if fun is None:
            continue
        method = isinstance(fun, classmethod)
        inner = fun.__func__ if method else fun

        def timed(*a, _inner=inner, _column=column, **kw):
            start = now()
            out = _inner(*a, **kw)
            try:
                jax.block_until_ready(out)
            except Exception:  # not a tree of arrays (a reader, a tokenizer)
                pass
            spans.append((_column, start, now()))
            return out

        setattr(owner, name, classmethod(timed) if method else timed)


# -- the parent -------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _home_with_models(base: Path) -> Path:
    """A fresh $RJAX_HOME that sees the catalog's models (a link) but has no compile cache."""
    home = Path(tempfile.mkdtemp(prefix="rjax-startup-", dir=base))
    models = Path(os.environ.get("RJAX_HOME") or "~/.cache/rjax").expanduser() / "models"
    models.mkdir(parents=True, exist_ok=True)
    (home / "models").symlink_to(models)
    return home


def _cpu_s(pid: int) -> float | None:
    """CPU seconds the process has used so far, all its threads (Linux); a wall time on a shared
    machine depends on the load, its CPU time much less."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def run_once(what: str, model: str, home: Path, max_new_tokens: int, timeout_s: float, raw: bool = False) -> dict:
    """One measured process. -> its wall time to the milestone and its breakdown."""
    record = home / f"record-{what}-{time.time_ns()}.json"
    port = _free_port()
    env = dict(os.environ, RJAX_HOME=str(home), PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))), PYTHONUNBUFFERED="1")
    t0 = time.time()
    env["RJAX_STARTUP_T0"] = repr(t0)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", what, "--model", model, "--record", str(record),
           "--port", str(port), "--max-new-tokens", str(max_new_tokens)] + ["--raw"] * raw
    # The child's log goes to a file: a pipe nobody reads while polling /health fills up with
    # uvicorn's access log, and the server then blocks writing it.
    log_path = record.with_suffix(".log")
    log_file = open(log_path, "wb")
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log_file if what == "serve" else subprocess.PIPE,
                         stderr=log_file)
    milestone = cpu = None
    try:
        if what == "serve":
            while milestone is None and time.time() - t0 < timeout_s:
                if p.poll() is not None:
                    raise RuntimeError(f"rjax serve exited with {p.returncode}: "
                                       f"{log_path.read_bytes().decode(errors='replace')[-2000:]}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                        if r.status == 200:
                            milestone, cpu = time.time() - t0, _cpu_s(p.pid)
                except OSError:
                    time.sleep(0.05)
            p.send_signal(signal.SIGINT)
        else:
            if p.stdout.read(1):
                milestone, cpu = time.time() - t0, _cpu_s(p.pid)
        p.communicate(timeout=timeout_s)
    except BaseException:
        p.kill()
        p.wait()
        raise
    finally:
        log_file.close()
    if milestone is None or (what != "serve" and p.returncode != 0):
        raise RuntimeError(f"{what} failed (exit {p.returncode}; not there within {timeout_s:.0f} s?): "
                           f"{log_path.read_bytes().decode(errors='replace')[-2000:]}")
    rec = json.loads(record.read_text())
    return dict(breakdown(rec, milestone), cpu_s=cpu)


def breakdown(rec: dict, milestone: float) -> dict:
    """What the events up to the milestone add up to."""
    marks = rec["marks"]
    before = [e for e in rec["events"] if e[2] <= milestone + 1e-3]
    total = lambda name: sum(d for e, d, _, _ in before if e == name)  # noqa: E731
    count = lambda name: sum(1 for e, *_ in before if e == name)  # noqa: E731
    row = {"wall_s": milestone, "import_s": marks.get("import", 0.0),
           "load_s": marks.get("load", 0.0) - marks.get("import", 0.0) if "load" in marks else 0.0,
           "trace_s": total(TRACE), "lower_s": total(LOWER),
           "compile_s": total(COMPILE) - total(CACHE_READ), "cache_read_s": total(CACHE_READ),
           "cache_hits": count(HIT), "cache_misses": count(MISS), "programs": count(COMPILE)}
    row["rest_s"] = max(0.0, milestone - row["import_s"] - row["load_s"] - row["trace_s"] - row["lower_s"]
                        - row["compile_s"] - row["cache_read_s"])
    for column, start, end in marks.get("spans", ()):
        if end <= milestone + 1e-3:
            row[column] = row.get(column, 0.0) + end - start
    if "load" in marks and "first_token" in marks:
        row["after_load_s"] = marks["first_token"] - marks["load"]
    programs: dict[str, dict] = {}
    for e, d, _, fn in before:
        if e in (TRACE, LOWER, COMPILE):
            p = programs.setdefault(fn, {"trace_s": 0.0, "lower_s": 0.0, "compile_s": 0.0, "n": 0})
            p[{TRACE: "trace_s", LOWER: "lower_s", COMPILE: "compile_s"}[e]] += d
            p["n"] += e == COMPILE
    row["per_program"] = dict(sorted(programs.items(), key=lambda kv: -sum(v for k, v in kv[1].items() if k != "n")))
    return row


COLUMNS = ("wall_s", "cpu_s", "import_s", "load_s", "trace_s", "lower_s", "compile_s", "cache_read_s", "rest_s", "programs",
           "cache_hits", "cache_misses", "after_load_s") + tuple(dict.fromkeys(c for c, _, _ in SPANS))


def median_row(rows: list[dict]) -> dict:
    out = {c: statistics.median(r[c] for r in rows) for c in COLUMNS if all(r.get(c) is not None for r in rows)}
    out["runs_wall_s"] = [round(r["wall_s"], 2) for r in rows]
    return out


def table(results: dict) -> str:
    head = ["what", "cache", "wall", "runs", "cpu", "import", "load", "trace", "lower", "compile", "cache rd", "rest",
            "progs", "hits", "miss", "after load", "header", "weights", "tokenizer", "fuse", "layout", "prog rd"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for key, r in results.items():
        what, cache = key.split(":")
        f = lambda c: f"{r[c]:.1f}" if c in r else "-"  # noqa: E731
        lines.append(" | ".join([what, cache, f("wall_s"), "/".join(f"{w:.1f}" for w in r["runs_wall_s"]),
                                 f("cpu_s"), f("import_s"), f("load_s"), f("trace_s"), f("lower_s"), f("compile_s"),
                                 f("cache_read_s"), f("rest_s"), str(int(r["programs"])), str(int(r["cache_hits"])),
                                 str(int(r["cache_misses"])), f("after_load_s"), f("header_s"), f("weights_s"),
                                 f("tokenizer_s"), f("fuse_s"), f("layout_s"), f("program_read_s")]))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="catalog name or model file (default: the default model)")
    ap.add_argument("--what", default=",".join(WHATS), help=f"comma-separated, of {WHATS}")
    ap.add_argument("--runs", type=int, default=3, help="runs per row, cold and warm (default 3; medians)")
    ap.add_argument("--cold-runs", type=int, default=None, help="cold runs per row (default: --runs)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--raw", action="store_true", help="prompt without the chat template (a synthetic model has none)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    ap.add_argument("--workdir", default=None, help="where the temporary $RJAX_HOMEs go (default: the system's)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON (per-program breakdown included)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--child", choices=WHATS, help=argparse.SUPPRESS)
    ap.add_argument("--record", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.model is None:
        sys.path.insert(0, str(ROOT))
        from rjax.loading.catalog import DEFAULT_MODEL
        a.model = DEFAULT_MODEL
    if a.child:
        return _child(a.child, a.model, a.max_new_tokens, a.port, a.record, a.raw)
    whats = [w.strip() for w in a.what.split(",") if w.strip()]
    if bad := [w for w in whats if w not in WHATS]:
        ap.error(f"--what: unknown {bad}; choose from {WHATS}")
    if a.model and Path(a.model).exists():
        a.model = str(Path(a.model).resolve())
    base = Path(a.workdir or tempfile.gettempdir())
    results: dict[str, dict] = {}
    raw: dict[str, list] = {}
    for what in whats:
        cold = []
        for i in range(a.runs if a.cold_runs is None else max(1, a.cold_runs)):
            home = _home_with_models(base)
            cold.append(run_once(what, a.model, home, a.max_new_tokens, a.timeout, a.raw))
            print(f"[startup] {what} cold run {i + 1}: {cold[-1]['wall_s']:.1f} s", file=sys.stderr, flush=True)
        warm = []
        for i in range(a.runs):  # the last cold run's cache
            warm.append(run_once(what, a.model, home, a.max_new_tokens, a.timeout, a.raw))
            print(f"[startup] {what} warm run {i + 1}: {warm[-1]['wall_s']:.1f} s", file=sys.stderr, flush=True)
        for cache, rows in (("cold", cold), ("warm", warm)):
            results[f"{what}:{cache}"] = median_row(rows)
            raw[f"{what}:{cache}"] = rows
    doc = {"model": a.model, "runs": a.runs, "max_new_tokens": a.max_new_tokens, "medians": results, "runs_detail": raw}
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1) if a.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
