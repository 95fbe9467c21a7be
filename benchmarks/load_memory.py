"""Peak host memory while loading a Hugging Face safetensors checkpoint, against the size of the
params it produces, beside a plain whole-file load measured in the same run.

    python benchmarks/load_memory.py [DIR ...] [--quantize q8_0] [--out FILE]

Without DIRs it measures the checkpoints that the oracle (transformers) saves from the two catalog
GGUFs (float32 weights, de-quantized; `tests/oracle`). Every measurement runs in a fresh child
process, which reports VmRSS after importing jax and touching the device (the baseline), then
loads, waits for the device arrays, and reports VmHWM, the resident-set high-water mark. On a
CPU backend the "device" arrays live in host memory too, so the params themselves count in the
peak: the figure to watch is (peak - baseline) / params. Modes:

  rjax           rjax.loading.loaders.safetensors.load_hf_dir
  rjax-<type>    the same with quantize=<type>
  load_file      safetensors.numpy.load_file (the whole file into host memory), then device_put
                 every tensor and drop the host dict: what a loader without streaming does

Prints one JSON object (and writes it to --out if given).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CATALOG = ("smollm2-135m-instruct", "gemma3-270m")
MIB = 1 << 20


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / MIB
    raise KeyError(key)


def child(mode: str, directory: str) -> dict:
    """One load in this (fresh) process -> its memory figures."""
    import jax
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()
    baseline = _status_mib("VmRSS")
    t0 = time.perf_counter()
    if mode == "load_file":
        import ml_dtypes  # noqa: F401 - numpy's bfloat16
        from safetensors.numpy import load_file

        files = sorted(Path(directory).glob("*.safetensors"))
        params = {}
        for file in files:
            host = load_file(file)
            params.update({name: jax.device_put(a) for name, a in host.items()})
            del host
    else:
        from rjax.loading.loaders.safetensors import load_hf_dir

        quantize = mode.split("-", 1)[1] if "-" in mode else None
        _, params = load_hf_dir(directory, progress=False, quantize=quantize)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    params_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(params))
    peak = _status_mib("VmHWM")
    return dict(mode=mode, load_s=round(seconds, 2), params_mib=round(params_bytes / MIB, 1),
                baseline_rss_mib=round(baseline, 1), peak_rss_mib=round(peak, 1),
                after_rss_mib=round(_status_mib("VmRSS"), 1),
                peak_over_baseline_mib=round(peak - baseline, 1),
                peak_over_baseline_per_params=round((peak - baseline) / (params_bytes / MIB), 3))


def measure(mode: str, directory: Path) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", mode, str(directory)],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        return dict(mode=mode, error=(proc.stdout + proc.stderr)[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def catalog_checkpoints() -> dict[str, Path]:
    from rjax.loading.catalog import resolve_model
    from tests.oracle.client import oracle_save_pretrained

    return {name: oracle_save_pretrained(resolve_model(name, progress=False)) for name in CATALOG}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="*", type=Path, help="checkpoint directories (default: the catalog models')")
    p.add_argument("--quantize", action="append", default=[], help="also measure quantize-on-load to this type")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0

    models = {d.name: d for d in args.dirs} if args.dirs else catalog_checkpoints()
    modes = ["rjax", *(f"rjax-{q}" for q in args.quantize), "load_file"]
    results = {}
    for name, directory in models.items():
        files = sorted(directory.glob("*.safetensors"))
        results[name] = dict(path=str(directory), file_mib=round(sum(f.stat().st_size for f in files) / MIB, 1),
                             runs=[measure(mode, directory) for mode in modes])
        for run in results[name]["runs"]:
            print(f"{name:24} {run['mode']:10} " + (
                f"params {run['params_mib']:8.1f} MiB  peak-baseline {run['peak_over_baseline_mib']:8.1f} MiB "
                f"({run['peak_over_baseline_per_params']:.2f}x params)  load {run['load_s']:.1f} s"
                if "error" not in run else f"error: {run['error'][-300:]}"), file=sys.stderr)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
