#!/bin/bash
# Session 12 device run 4: int8 GEMV tiles of the Q6_K output layers (llama-8b, llama-1b) and of
# llama-8b's gate/up and down products with 8 warps beside 4.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 280 python3 benchmarks/int8_gemv_tiles.py --type Q6_K --shapes 8b-out,1b-out --out $OUT/q6k-out.json 2>&1 \
  | grep -v "Delay kernel\|Warning" | tail -11
timeout $(( 580 - ($(date +%s) - T0) )) python3 benchmarks/int8_gemv_tiles.py --type Q4_K --shapes 8b-gateup,8b-down \
  --out $OUT/q4k-warps.json 2>&1 | grep -v "Delay kernel\|Warning" | tail -11
echo "elapsed $(( $(date +%s) - T0 ))"
