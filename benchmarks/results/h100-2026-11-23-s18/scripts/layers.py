"""Decode wall time per token against the layer count (session 18 run 7): rjax bench at batch 1
on synthetic models that differ only in their number of layers; the slope is a layer's wall
time in the decode loop, the intercept the step's own (LM head, sampling, loop)."""
import json, subprocess, sys, tempfile
from pathlib import Path

runs = []
for shape, quant, layers in [("smollm2-135m", "q4_1", 6), ("smollm2-135m", "q4_1", 30),
                             ("llama-1b", "q4_k", 4), ("llama-1b", "q4_k", 16)] * 2:
    path = Path(f"/tmp/m/{shape}-{quant}-{layers}.gguf")
    if not path.exists():
        subprocess.run([sys.executable, "-m", "rjax.cli", "synth", shape, "--quant", quant, "--layers", str(layers),
                        "-o", str(path), "-q"], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "b.json"
        subprocess.run([sys.executable, "-m", "rjax.cli", "bench", "-m", str(path), "--batch", "1",
                        "--steps-per-dispatch", "16", "-q", "--json", str(out)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = json.loads(out.read_text())
    tg = r["summary"]["tg"] if "summary" in r else r["tg"]
    runs.append(dict(shape=shape, quant=quant, layers=layers, tg=tg, us_per_token=1e6 / tg))
    print(runs[-1], flush=True)
print(json.dumps(runs))
