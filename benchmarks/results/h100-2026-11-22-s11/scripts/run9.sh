#!/bin/bash
# Session 11 device run 9: A/B of the fused residual add + norm at batch 2 and 4 (ADD_NORM_MAX_M
# is 4), llama-1b Q4_K and llama-8b, against ADD_NORM_MAX_M=0.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
timeout $(( 585 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/l1b.gguf,/tmp/m/l8b.gguf \
  --batches 2,4 --arm off=pallas_kernels.quant_matmul.gemv:ADD_NORM_MAX_M=0 --rounds 2 --out $OUT/ab.json 2>&1 \
  | grep -v "Delay kernel" | tail -12
echo "elapsed $(( $(date +%s) - T0 ))"
