"""End to end against llama.cpp: prefill and decode tokens/s of synthetic models of real shapes,
beside llama.cpp's numbers for the same shapes and the HBM roofline of this run.

    python benchmarks/e2e.py --out "$OUT" --budget 540

Peers: llama.cpp's llama-bench (pp512 / tg128, flash attention on, and batched decode of 32
sequences for llama-8b) on the same synthetic shapes on an H100 80GB HBM3. Those numbers are
recorded in LLAMA_CPP below, not measured by this script. The host they came from copied at
LLAMA_CPP_COPY_GB_S, so read them beside this run's copy rate (the table's GB/s column).
Measured in this run: the device-to-device copy bandwidth and, from it, each model's batch-1
decode roofline (`rjax bench`).

For each (shape, mix) in turn: write the synthetic GGUF under --workdir (local disk), then run
`rjax bench` on it in a child process (so a crash or an out-of-memory error loses only that
model), with prompt 512, 128 generated tokens, batches 1, 8, 32 and 1, 16 or 128 steps per
dispatch (the best is reported). Each model gets a share of the time budget in proportion to
its weight; time a model leaves unused passes on to the next ones. A bench that reaches its
share skips its remaining measurements cleanly; one that overruns is killed, and the JSON it had
written so far is kept (bench rewrites it after every measurement). `<out>/e2e.json` collects
everything and is rewritten after each model; the last thing printed is a table beside
llama.cpp's numbers. docs/kernels.md explains what the decode step spends its time on.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (shape, mix, time weight)
MODELS = (("smollm2-135m", "q4_1", 1.0), ("llama-1b", "q4_k", 1.5), ("llama-1b", "q8_0", 1.5),
          ("llama-8b", "q4_k", 3.5))

# llama.cpp on one H100 80GB HBM3, the same synthetic shapes: llama-bench pp512 / tg128,
# flash attention on; b32 = batched decode with 32 sequences (tokens/s over all of them).
LLAMA_CPP = {
    ("smollm2-135m", "q4_1"): {"pp": 54603, "tg": 923},
    ("llama-1b", "q4_k"): {"pp": 44591, "tg": 988},
    ("llama-1b", "q8_0"): {"pp": 49279, "tg": 861},
    ("llama-8b", "q4_k"): {"pp": 10353, "tg": 296, "b32": 3356},
}
LLAMA_CPP_COPY_GB_S = 2931
TARGETS = {  # rjax's goals on the same GPU
    ("smollm2-135m", "q4_1"): {"tg": 1400},
    ("llama-1b", "q4_k"): {"tg": 2000},
    ("llama-8b", "q4_k"): {"tg": 370, "pp": 15000},
}


def say(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _fmt(x, spec=",.0f") -> str:
    return "-" if x is None else format(x, spec)


def compact_row(shape: str, mix: str, bench: dict | None, status: str) -> dict:
    s = (bench or {}).get("summary") or {}
    if bench and not s:  # a bench killed mid-way: derive what it had measured
        from rjax.cli.bench_report import summarize

        s = summarize(bench)
    ref = LLAMA_CPP.get((shape, mix), {})
    tgt = TARGETS.get((shape, mix), {})
    b32 = (s.get("decode_by_batch") or {}).get("32", {})
    return {"model": f"{shape} {mix}", "status": status, "pp": s.get("pp"), "pp_llama_cpp": ref.get("pp"),
            "pp_target": tgt.get("pp"), "tg": s.get("tg"), "tg_n": s.get("tg_steps_per_dispatch"),
            "tg_llama_cpp": ref.get("tg"), "tg_target": tgt.get("tg"),
            "b32": b32.get("tokens_per_s"), "b32_llama_cpp": ref.get("b32"),
            "tg_roofline": s.get("roofline_tg"), "tg_roofline_fraction": s.get("roofline_fraction_tg"),
            "compile_s": s.get("compile_s_total"), "bandwidth_gb_per_s": s.get("bandwidth_gb_per_s"),
            "load_s": ((bench or {}).get("model") or {}).get("load_s"),
            "peak_gib": None if s.get("peak_bytes_in_use") is None else s["peak_bytes_in_use"] / 2**30}


def format_rows(rows: list[dict], pp_label: str = "pp512", tg_label: str = "tg128") -> str:
    head = (f"{'model':18} {pp_label:>8} {'llama.cpp':>9} {tg_label:>7} {'N':>3} {'llama.cpp':>9} {'target':>6} "
            f"{'B=32':>7} {'llama.cpp':>9} {'roofline':>8} {'frac':>5} {'compile':>7} {'GB/s':>6} {'GiB':>5}  status")
    lines = [head, "-" * len(head)]
    for r in rows:
        frac = "-" if r["tg_roofline_fraction"] is None else f"{r['tg_roofline_fraction']:.0%}"
        lines.append(
            f"{r['model']:18} {_fmt(r['pp']):>8} {_fmt(r['pp_llama_cpp']):>9} {_fmt(r['tg']):>7} "
            f"{_fmt(r['tg_n'], 'd'):>3} {_fmt(r['tg_llama_cpp']):>9} {_fmt(r['tg_target']):>6} "
            f"{_fmt(r['b32']):>7} {_fmt(r['b32_llama_cpp']):>9} {_fmt(r['tg_roofline']):>8} {frac:>5} "
            f"{_fmt(r['compile_s'], '.1f'):>7} {_fmt(r['bandwidth_gb_per_s']):>6} {_fmt(r['peak_gib'], '.1f'):>5}"
            f"  {r['status']}")
    lines.append(f"{pp_label} = prefill tokens/s (batch 1); {tg_label} = decode tokens/s at batch 1 (best N steps per "
                 f"dispatch); B=32 = decode tokens/s over 32 sequences; roofline = batch-1 decode ceiling at the "
                 f"measured copy bandwidth (llama.cpp's device copy: {LLAMA_CPP_COPY_GB_S:,} GB/s); compile = "
                 f"seconds compiling, all programs; GiB = peak device memory. Targets: llama-8b q4_k tg >= 370, pp512 >= 15,000; "
                 f"llama-1b q4_k tg >= 2,000; smollm2-135m tg >= 1,400.")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "e2e-out", help="results folder (default: $OUT)")
    p.add_argument("--workdir", default="/tmp/rjax-e2e", help="where the synthetic models are written")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for everything (default 540)")
    p.add_argument("--models", default=None,
                   help="comma-separated shape:mix list (default: " + ",".join(f"{s}:{m}" for s, m, _ in MODELS) + ")")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--steps-per-dispatch", default="128,16,1")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=None, help="override every shape's layer count (smoke tests)")
    p.add_argument("--vocab", type=int, default=None, help="override every shape's vocabulary (smoke tests)")
    p.add_argument("--tokenizer-from", default=None, help="passed to rjax synth")
    p.add_argument("--copy-mib", type=float, default=None, help="passed to rjax bench")
    a = p.parse_args(argv)
    # The children get the environment as it was; this process (synthesis only, numpy) is kept
    # off the accelerator so it never holds device memory the benchmarks need.
    child_env = dict(os.environ)
    os.environ["JAX_PLATFORMS"] = "cpu"

    t_start = time.perf_counter()
    deadline = t_start + a.budget
    out, work = Path(a.out), Path(a.workdir)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if a.models:
        weights = {(s, m): w for s, m, w in MODELS}
        models = [(s, m, weights.get((s, m), 1.5)) for s, m in (x.split(":") for x in a.models.split(","))]
    else:
        models = list(MODELS)
    say(f"python {sys.version.split()[0]}, budget {a.budget:.0f} s, models: "
        + ", ".join(f"{s} {m}" for s, m, _ in models))

    from rjax.loading.synth import write_synthetic

    plotting = importlib.util.find_spec("matplotlib") is not None

    summary: dict = {"budget_s": a.budget, "llama_cpp": {f"{s} {m}": v for (s, m), v in LLAMA_CPP.items()},
                     "llama_cpp_copy_gb_per_s": LLAMA_CPP_COPY_GB_S, "models": {}, "rows": []}
    summary_path = out / "e2e.json"

    def save():
        summary["elapsed_s"] = time.perf_counter() - t_start
        tmp = summary_path.with_name(summary_path.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, summary_path)

    for i, (shape, mix, weight) in enumerate(models):
        key = f"{shape} {mix}"
        remaining = deadline - time.perf_counter()
        share = remaining * weight / sum(w for _, _, w in models[i:])
        record: dict = {"shape": shape, "mix": mix, "share_s": share}
        summary["models"][key] = record
        bench_json = out / f"bench-{shape}-{mix}.json"
        status = "ok"
        if remaining < 20:
            say(f"{key}: skipped, {remaining:.0f} s left")
            record["status"] = status = "skipped (time budget)"
            summary["rows"].append(compact_row(shape, mix, None, status))
            save()
            continue
        t0 = time.perf_counter()
        try:
            say(f"{key}: synthesizing ({share:.0f} s share of {remaining:.0f} s left)")
            path = work / f"synthetic-{shape}-{mix}.gguf"
            if not path.exists():
                write_synthetic(path, shape, mix, n_layers=a.layers, vocab_size=a.vocab,
                                tokenizer_from=a.tokenizer_from)
            record["synth_s"] = time.perf_counter() - t0
            record["file_bytes"] = path.stat().st_size
            say(f"{key}: {path} ({path.stat().st_size / 1e9:.2f} GB) in {record['synth_s']:.1f} s")
            bench_budget = max(10.0, share - (time.perf_counter() - t0) - 20)
            cmd = [sys.executable, "-m", "rjax.cli", "bench", "-m", str(path), "--prompt-len", str(a.prompt_len),
                   "--gen", str(a.gen), "--batch", a.batch, "--steps-per-dispatch", a.steps_per_dispatch,
                   "--repeats", str(a.repeats), "--json", str(bench_json), "--time-budget", f"{bench_budget:.0f}"]
            if a.copy_mib:
                cmd += ["--copy-mib", str(a.copy_mib)]
            if plotting:
                cmd += ["--plot", str(out / f"bench-{shape}-{mix}.png")]
            hard_limit = max(15.0, min(deadline - time.perf_counter(), share - (time.perf_counter() - t0) + 60))
            say(f"{key}: bench (measurement budget {bench_budget:.0f} s, killed after {hard_limit:.0f} s)")
            try:
                proc = subprocess.run(cmd, cwd=ROOT, env=child_env, timeout=hard_limit)
                record["returncode"] = proc.returncode
                if proc.returncode != 0:
                    status = f"bench exited {proc.returncode}"
            except subprocess.TimeoutExpired:
                status = f"killed after {hard_limit:.0f} s (partial)"
        except Exception as e:  # noqa: BLE001 - keep going with the other models
            status = f"failed: {type(e).__name__}: {e}"
        record["wall_s"] = time.perf_counter() - t0
        bench = None
        if bench_json.exists():
            try:
                bench = json.loads(bench_json.read_text())
            except json.JSONDecodeError as e:
                status += f"; unreadable JSON ({e})"
        if bench is not None:
            record["bench"] = bench
            if status == "ok" and bench.get("status") != "done":
                status = f"partial ({len(bench.get('skipped', []))} skipped, {len(bench.get('errors', []))} errors)"
        record["status"] = status
        row = compact_row(shape, mix, bench, status)
        summary["rows"].append(row)
        save()
        say(f"{key}: {status} in {record['wall_s']:.0f} s: pp {_fmt(row['pp'])}, tg {_fmt(row['tg'])} tokens/s "
            f"(llama.cpp {_fmt(row['tg_llama_cpp'])}), compile {_fmt(row['compile_s'], '.1f')} s")

    save()
    print("\n" + format_rows(summary["rows"], f"pp{a.prompt_len}", f"tg{a.gen}"), flush=True)
    print(f"\nresults: {summary_path} (+ bench-*.json beside it); {time.perf_counter() - t_start:.0f} s in all",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
