#!/bin/bash
# Session 18 device run 1: PendingNorm (the add + norm between layers applied by the float
# kernel of the q/k/v and gate/up products). GPU tests, smollm2 B=1 A/B against the switch off,
# and a profile with it.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pending_norm.py tests/test_float_glu.py tests/test_gated_x.py 2>&1 | tail -8
echo "elapsed $(( $(date +%s) - T0 ))"
mkdir -p /tmp/m
[ -f /tmp/m/sm.gguf ] || python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/sm.gguf -q
G=pallas_kernels.quant_matmul.gemv
timeout 100 python3 benchmarks/profile_decode.py --shape smollm2-135m --quant q4_1 --batch 1 --top 40 --out $OUT 2>&1 | grep -v "Delay kernel" | tail -42 > $OUT/run1-prof-sm.txt
head -30 $OUT/run1-prof-sm.txt
echo "elapsed $(( $(date +%s) - T0 ))"
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/sm.gguf --batches 1 --rounds 3 \
  --arm off=$G:PENDING_NORM_MAX_M=0 --out $OUT/run1-ab-sm.json 2>&1 | grep -v "Delay kernel" | tail -6
echo "elapsed $(( $(date +%s) - T0 ))"
