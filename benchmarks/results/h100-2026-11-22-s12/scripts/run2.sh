#!/bin/bash
# Session 12 device run 2: A/B of the gate/up product applying the GLU (GLU_MAX_M=1, the default
# now) against the product + GLU rounding pass (GLU_MAX_M=0), batch 1, llama-1b Q4_K and llama-8b.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
timeout $(( 585 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/l1b.gguf,/tmp/m/l8b.gguf \
  --batches 1 --arm noglu=pallas_kernels.quant_matmul.gemv:GLU_MAX_M=0 --rounds 2 --out $OUT/ab.json 2>&1 \
  | grep -v "Delay kernel" | tail -8
echo "elapsed $(( $(date +%s) - T0 ))"
