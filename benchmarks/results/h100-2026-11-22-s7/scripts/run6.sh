#!/bin/bash
# Session 7 device run 6: where a decode step goes now (llama-8b and llama-1b Q4_K, B=1, final code).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 250 python3 benchmarks/profile_decode.py --out /tmp/p8 --shape llama-8b --quant q4_k > $OUT/prof-llama-8b.txt 2>&1; head -16 $OUT/prof-llama-8b.txt
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 150 python3 benchmarks/profile_decode.py --out /tmp/p1 --shape llama-1b --quant q4_k > $OUT/prof-llama-1b.txt 2>&1; head -16 $OUT/prof-llama-1b.txt
echo "elapsed $(( $(date +%s) - T0 ))"
