#!/bin/bash
# Session 11 device run 5: the fixed GPU test of the fused residual add + norm; A/B at batch 1
# (and 4) of the fused path against ADD_NORM_MAX_M=0 on llama-8b, llama-1b Q4_K and Q8_0.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_int8_gemv_add_norm.py --tb=short 2>&1 \
  | grep -v Warning | tail -20 > $OUT/gpu-tests.txt; tail -3 $OUT/gpu-tests.txt
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
python3 -m rjax.cli synth llama-1b --quant q8_0 -o /tmp/m/l1b-q8.gguf -q
echo "synth done $(( $(date +%s) - T0 ))"
timeout $(( 585 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/l8b.gguf,/tmp/m/l1b.gguf,/tmp/m/l1b-q8.gguf \
  --batches 1 --arm off=pallas_kernels.quant_matmul.gemv:ADD_NORM_MAX_M=0 --rounds 2 --out $OUT/ab.json 2>&1 \
  | grep -v "Delay kernel" | tail -14
echo "elapsed $(( $(date +%s) - T0 ))"
