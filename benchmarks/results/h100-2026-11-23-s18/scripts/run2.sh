#!/bin/bash
# Session 18 device run 2: PendingNorm with the squares summed in the loop (one split) or the
# whole row loaded ahead of the loop (several): kernel times against the norm kernel + product,
# GPU tests, and smollm2 B=1 A/B: default splits, one split, off.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 150 python3 benchmarks/pending_norm.py --out $OUT/run2-pending-norm.json 2>&1 | grep -v "Delay kernel\|^W\|^I"
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pending_norm.py 2>&1 | tail -3
echo "elapsed $(( $(date +%s) - T0 ))"
mkdir -p /tmp/m
[ -f /tmp/m/sm.gguf ] || python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/sm.gguf -q
G=pallas_kernels.quant_matmul.gemv
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/sm.gguf --batches 1 --rounds 2 \
  --arm one=$G:PENDING_NORM_ONE_SPLIT=1 --arm off=$G:PENDING_NORM_MAX_M=0 --out $OUT/run2-ab-sm.json 2>&1 | grep -v "Delay kernel" | tail -6
echo "elapsed $(( $(date +%s) - T0 ))"
