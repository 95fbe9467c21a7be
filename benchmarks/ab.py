"""A/B of dispatch constants end to end: `rjax bench` decode tokens/s with module constants set
one way or another, each arm in a fresh process, arms alternated so drift hits them alike.

    python benchmarks/ab.py --models /tmp/m/l8b.gguf,/tmp/m/l1b.gguf \
        --arm fused=pallas_kernels.attention:FUSED_ROPE_MAX_ROWS=256 \
        --arm gated=pallas_kernels.quant_matmul.gemv:GATED_X_MAX_M=64 --rounds 2 --out ab.json

The baseline arm ("base") runs the constants as committed. An arm sets integer constants
(`module:NAME=value`, several separated by commas; `module:NAME[KEY]=value` for the entry of a
dict constant whose key is named KEY, e.g. `gemv:INT8_MIN_VALUES[Q4_1]=0`) before rjax is
imported in its process, or
runs another source tree as it is (`NAME=@PATH`, e.g. a `git archive` of an earlier commit;
the child runs from PATH, so `python -c` imports that tree's rjax, and prints which it took), or
adds XLA flags to the child's XLA_FLAGS (`NAME=xla:--flag=value --flag2=value`).
Every run is `rjax bench` with the given batches, N=16 steps per dispatch, prompt 512 and 128
generated (--bench-args to change); the table gives tokens/s per model, batch and arm, each
round's value and the median, and the ratio of each arm's median to the baseline's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs in the child: patch, then the bench's own command line.
_CHILD = """
import os, sys
import rjax
print("[ab] rjax from", os.path.dirname(rjax.__file__), file=sys.stderr)
if os.environ["RJAX_AB_PATCH"]:
    from benchmarks.profile_decode import set_constants
    set_constants(os.environ["RJAX_AB_PATCH"].split(","))
from rjax.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _arm(text: str) -> tuple[str, str]:
    name, _, patch = text.partition("=")
    if not name or not patch or (":" not in patch and not patch.startswith("@")):
        raise argparse.ArgumentTypeError(f"expected NAME=module:CONSTANT=value[,...] or NAME=@PATH, got {text!r}")
    return name, patch


def run_arm(model: str, patch: str, batches: str, bench_args: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-c", _CHILD, "bench", "-m", model, "--batch", batches, "--steps-per-dispatch", "16",
               "-q", "--json", str(out), *bench_args]
        tree = Path(patch[1:]).resolve() if patch.startswith("@") else ROOT
        flags = patch[4:] if patch.startswith("xla:") else ""
        env = dict(os.environ, RJAX_AB_PATCH="" if patch.startswith(("@", "xla:")) else patch,
                   PYTHONPATH=os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]),
                   XLA_FLAGS=" ".join(filter(None, [os.environ.get("XLA_FLAGS"), flags])))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=timeout)
        took = [line for line in proc.stderr.splitlines() if line.startswith("[ab] rjax from")]
        if took:
            print(took[0], file=sys.stderr, flush=True)
        if proc.returncode != 0 or not out.exists():
            return {"error": (proc.stderr or proc.stdout)[-800:], "seconds": time.perf_counter() - t0}
        summary = json.loads(out.read_text())["summary"]
        return {"tokens_per_s": {b: v["tokens_per_s"] for b, v in summary["decode_by_batch"].items()},
                "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True, help="comma-separated model paths or catalog names")
    ap.add_argument("--arm", type=_arm, action="append", required=True, metavar="NAME=module:CONST=value[,...]")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--rounds", type=int, default=2, help="times each arm runs per model, alternated")
    ap.add_argument("--bench-args", default="--prompt-len 512 --gen 128 --repeats 3",
                    help="passed to rjax bench as they are")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run")
    ap.add_argument("--out", default=None, help="JSON of every run (rewritten after each)")
    a = ap.parse_args(argv)
    arms = [("base", "")] + a.arm
    results: dict = {"arms": dict(arms), "runs": []}
    for model in a.models.split(","):
        for r in range(a.rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            for name, patch in order:
                res = run_arm(model, patch, a.batches, a.bench_args.split(), a.timeout)
                results["runs"].append(dict(model=model, arm=name, round=r, **res))
                print(f"[ab] {Path(model).name} {name} round {r}: "
                      f"{res.get('tokens_per_s') or res.get('error', '')[-200:]}", file=sys.stderr, flush=True)
                if a.out:
                    Path(a.out).write_text(json.dumps(results, indent=1))
    print(format_table(results))
    return 0 if all("error" not in r for r in results["runs"]) else 1


def format_table(results: dict) -> str:
    lines = [f"{'model':28} {'B':>3} {'arm':10} {'runs (tokens/s)':28} {'median':>9} {'vs base':>8}"]
    keys = dict.fromkeys((r["model"], b) for r in results["runs"] for b in r.get("tokens_per_s", {}))
    for model, b in keys:
        base = None
        for arm in results["arms"]:
            vals = [r["tokens_per_s"][b] for r in results["runs"]
                    if r["model"] == model and r["arm"] == arm and b in r.get("tokens_per_s", {})]
            if not vals:
                continue
            med = statistics.median(vals)
            base = med if arm == "base" else base
            ratio = f"{med / base:.3f}" if base else "-"
            lines.append(f"{Path(model).name:28} {b:>3} {arm:10} {', '.join(f'{v:,.1f}' for v in vals):28} "
                         f"{med:>9,.1f} {ratio:>8}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
