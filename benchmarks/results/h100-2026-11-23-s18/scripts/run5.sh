#!/bin/bash
# Session 18 device run 5: smollm2-135m Q4_1 at batch 1 with GATED_X_MAX_M=1 (the GLU applied
# by the down product's float kernel) against 0, and with the one-token attention capped at 4
# splits; GPU tests of the GatedX kernels.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gated_x.py 2>&1 | tail -2
mkdir -p /tmp/m
[ -f /tmp/m/sm.gguf ] || python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/sm.gguf -q
G=pallas_kernels.quant_matmul.gemv
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/sm.gguf --batches 1 --rounds 3 \
  --arm nogated=$G:GATED_X_MAX_M=0 --arm splits4=pallas_kernels.attention.decode:MAX_MERGED_SPLITS=4 \
  --out $OUT/run5-ab-sm.json 2>&1 | grep -v "Delay kernel" | tail -5
echo "elapsed $(( $(date +%s) - T0 ))"
