"""Issue 6's closing table from quant_matmul.py JSON files: per type and shape, what qmatmul runs at
M = 1, 16, 64 and 2048, its time over the M=1 time, and XLA's bf16 dot as the baseline."""
import json, sys, glob
rows = []; meta = []
for f in sys.argv[1:]:
    d = json.load(open(f)); meta.append((f.split('/')[-1], round(d["hbm_copy_GBps"]), round(d["bf16_peak_TFLOPs"])))
    for r in d["rows"]: r["_hbm"] = d["hbm_copy_GBps"]; rows.append(r)
print(meta)
def get(kind, t, n, k, m):
    for r in rows:
        if r["kind"] == kind and r["type"] == t and r["N"] == n and r["K"] == k and r["M"] == m and not r.get("error"):
            return r
types = []
for r in rows:
    if r["type"] not in types and r["type"] != "bf16": types.append(r["type"])
shapes = []
for r in rows:
    if (r["N"], r["K"]) not in shapes: shapes.append((r["N"], r["K"]))
print("| type | N x K | M=1 us (% HBM) [path] | M=16 us [path] | M=16/M=1 | M=64 us | M=64/M=1 | M=2048 TFLOP/s (% of XLA bf16) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for t in types:
    for (n, k) in shapes:
        r1 = get("qmatmul", t, n, k, 1)
        if not r1: continue
        r16, r64, rp = get("qmatmul", t, n, k, 16), get("qmatmul", t, n, k, 64), get("qmatmul", t, n, k, 2048)
        bp = get("xla_bf16", "bf16", n, k, 2048)
        l2 = "*" if r1.get("l2_resident") else ""
        c1 = f"{r1['time_us']:.1f} ({100*r1['weight_GBps']/r1['_hbm']:.0f}%){l2} {r1['path']}"
        c16 = f"{r16['time_us']:.1f} {r16['path']}" if r16 else "-"
        v16 = f"{r16['vs_m1']:.2f}" if r16 and 'vs_m1' in r16 else "-"
        c64 = f"{r64['time_us']:.1f} {r64['path']}" if r64 else "-"
        v64 = f"{r64['vs_m1']:.2f}" if r64 and 'vs_m1' in r64 else "-"
        cp = f"{rp['TFLOPs']:.0f} ({100*rp['TFLOPs']/bp['TFLOPs']:.0f}%)" if rp and bp else "-"
        print(f"| {t} | {n}x{k} | {c1} | {c16} | {v16} | {c64} | {v64} | {cp} |")
print()
print("bf16 XLA: | N x K | M=1 us (%HBM) | M=16 | M=64 | M=2048 TFLOP/s |")
for (n, k) in shapes:
    b = [get("xla_bf16", "bf16", n, k, m) for m in (1, 16, 64, 2048)]
    if b[0]:
        print(f"| {n}x{k} | {b[0]['time_us']:.1f} ({100*b[0]['weight_GBps']/b[0]['_hbm']:.0f}%) | {b[1]['time_us']:.1f} | {b[2]['time_us']:.1f} | {b[3]['TFLOPs']:.0f} |")
errs = [r for r in rows if r.get("error")]
print("errors:", len(errs), [ (r['kind'], r['type'], r['N'], r['K'], r['M'], r['error'][:80]) for r in errs][:8])
print("max rel_err", max(r.get("rel_err", 0) for r in rows), "nonfinite", [r for r in rows if r.get("finite") is False][:2])
