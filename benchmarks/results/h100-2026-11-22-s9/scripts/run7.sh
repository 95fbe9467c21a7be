#!/bin/bash
# Session 9 device run 7: batch-8 decode with the int8 MMA kernel on (default) and off.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q &
python3 -m rjax.cli synth llama-1b --quant q8_0 -o /tmp/m/l1b8.gguf -q; wait
OFF=pallas_kernels.quant_matmul.gemv:INT8_MMA_MAX_M=0
timeout 300 python3 benchmarks/ab.py --models /tmp/m/l8b.gguf --batches 8 --arm off=$OFF --rounds 2 --out $OUT/ab-mma-l8b.json 2>&1 | grep -v "Delay kernel" | tail -6
echo "8b done $(( $(date +%s) - T0 ))"
timeout $(( 570 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/l1b8.gguf --batches 8 --arm off=$OFF --rounds 1 --out $OUT/ab-mma-l1b8.json 2>&1 | grep -v "Delay kernel" | tail -6
echo "elapsed $(( $(date +%s) - T0 ))"
