"""`rjax bench`'s result: the headline summary, the JSON file, the table and the plot."""
from __future__ import annotations

import json
import os
from pathlib import Path

def summarize(result: dict) -> dict:
    """The headline numbers, llama-bench style (pp = prefill at batch 1, tg = decode at batch 1)."""
    s = result["settings"]
    out: dict = {"pp": None, "ttft_s": None, "tg": None, "tg_steps_per_dispatch": None,
                 "decode_by_batch": {}, "roofline_tg": None, "roofline_fraction_tg": None,
                 "compile_s_total": None, "bandwidth_gb_per_s": result.get("bandwidth", {}).get("gb_per_s")}
    p1 = [p for p in result.get("prefill", []) if p["batch"] == 1]
    if p1:
        out["pp"] = p1[0]["tokens_per_s"]
        out["ttft_s"] = p1[0]["ttft_s"]
    best: dict[int, dict] = {}
    for d in result.get("decode", []):
        if d["batch"] not in best or d["tokens_per_s"] > best[d["batch"]]["tokens_per_s"]:
            best[d["batch"]] = d
    for b, d in sorted(best.items()):
        out["decode_by_batch"][str(b)] = {"tokens_per_s": d["tokens_per_s"], "steps_per_dispatch": d["steps_per_dispatch"],
                                          "roofline_tokens_per_s": d["roofline"]["tokens_per_s"],
                                          "roofline_fraction": d["roofline_fraction"]}
    if 1 in best:
        out["tg"] = best[1]["tokens_per_s"]
        out["tg_steps_per_dispatch"] = best[1]["steps_per_dispatch"]
        out["roofline_tg"] = best[1]["roofline"]["tokens_per_s"]
        out["roofline_fraction_tg"] = best[1]["roofline_fraction"]
    host = {d["steps_per_dispatch"]: d["host_s_per_token"] for d in result.get("decode", []) if d["batch"] == 1}
    out["host_s_per_token_by_steps"] = {str(k): v for k, v in sorted(host.items())}
    # Compile time: the programs compiled ahead (lowering + the concurrent compiles' wall time),
    # plus what the first calls still spent beyond a steady call.
    comp = result.get("compile", {})
    times = [v for fn in ("prefill_and_sample", "decode_loop") for v in comp.get(fn, {}).values()]
    ahead = comp.get("ahead")
    out["compile_s_total"] = (float(sum(times)) + (ahead["total_s"] if ahead else 0.0)) if times or ahead else None
    end = (result.get("memory") or {}).get("end") or {}
    out["peak_bytes_in_use"] = end.get("peak_bytes_in_use")  # process-wide, bandwidth probe included
    out["label"] = f"pp{s['prompt_len']} / tg{s['gen']}"
    return out


# Top-level keys of a finished result (the test checks them all).
RESULT_KEYS = ("rjax_bench_version", "device", "settings", "status", "skipped", "errors", "bandwidth", "model",
               "memory", "prefill", "decode", "compile", "recompilation", "summary", "elapsed_s")


# ---------------------------------------------------------------------------------------------
# output

def write_json(result: dict, path: str | os.PathLike) -> None:
    """Atomically (re)write the result, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, path)


MATPLOTLIB_MISSING = "plotting needs matplotlib: pip install matplotlib (or rjax[plot])"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(MATPLOTLIB_MISSING) from None
    return plt


def plot(result: dict, path: str | os.PathLike) -> Path:
    """tokens/s against batch size, one line per steps-per-dispatch, with the roofline."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by_n: dict[int, list] = {}
    for d in result["decode"]:
        by_n.setdefault(d["steps_per_dispatch"], []).append((d["batch"], d["tokens_per_s"]))
    for n, pts in sorted(by_n.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"rjax, N={n} steps per dispatch")
    roof = sorted({(d["batch"], d["roofline"]["tokens_per_s"]) for d in result["decode"]})
    if roof:
        ax.plot([p[0] for p in roof], [p[1] for p in roof], "k--",
                label=f"roofline at {result['bandwidth']['gb_per_s']:.3g} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("decode tokens/s (all sequences)")
    name = Path(result["model"]["source"]).name if result["model"].get("source") else result["model"]["arch"]
    ax.set_title(f"{name} on {result['device']['kind']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_table(result: dict) -> str:
    lines = []
    m, bw = result.get("model", {}), result.get("bandwidth", {})
    lines.append(f"model {m.get('source') or m.get('arch')}: {m.get('weight_bytes', 0) / 1e9:.3f} GB weights, "
                 f"device {result['device']['kind']}, copy bandwidth {bw.get('gb_per_s', float('nan')):.1f} GB/s")
    for p in result.get("prefill", []):
        lines.append(f"  prefill B={p['batch']:<3} {p['tokens_per_s']:>12,.1f} tokens/s  {p['time_s'] * 1e3:9.2f} ms"
                     f"   first call {p['first_call_s']:.1f} s")
    lines.append(f"  {'decode':14} {'tokens/s':>12} {'p50 ms/tok':>11} {'p99':>8} {'host us/tok':>12} "
                 f"{'roofline':>10} {'frac':>6} {'compile s':>10}")
    for d in result.get("decode", []):
        lines.append(f"  B={d['batch']:<3} N={d['steps_per_dispatch']:<5} {d['tokens_per_s']:>12,.1f} "
                     f"{d['per_token_s']['p50'] * 1e3:>11.3f} {d['per_token_s']['p99'] * 1e3:>8.3f} "
                     f"{d['host_s_per_token'] * 1e6:>12.1f} {d['roofline']['tokens_per_s']:>10,.0f} "
                     f"{d['roofline_fraction']:>6.1%} {d['compile_s']:>10.1f}")
    ahead = result.get("compile", {}).get("ahead")
    if ahead:
        lines.append(f"  compiled {len(ahead['programs'])} programs ahead in {ahead['total_s']:.1f} s: lowering "
                     f"{ahead['lower_s']:.1f} s, then {ahead['wall_s']:.1f} s in {ahead['workers']} threads")
    rc = result.get("recompilation", {})
    if rc:
        lines.append("  programs compiled: " + ", ".join(f"{k} {v['programs']} (expected {v['expected']})"
                                                       for k, v in rc.items()))
    mem = (result.get("memory") or {}).get("end")
    if mem and "peak_bytes_in_use" in mem:
        lines.append(f"  peak device memory {mem['peak_bytes_in_use'] / 2**30:.2f} GiB")
    for k in ("skipped", "errors"):
        if result.get(k):
            lines.append(f"  {k}: {result[k]}")
    return "\n".join(lines)
