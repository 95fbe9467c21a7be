#!/bin/bash
# Session 10 device run 5: the int8 GEMV's tiles at one row for the llama-8b / llama-1b products;
# a llama-8b batch-1 profile of the new attention.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 330 python3 benchmarks/int8_gemv_tiles.py --out $OUT/gemv-tiles.json 2>&1 | grep -v "Delay kernel" | tail -42
echo "tiles done $(( $(date +%s) - T0 ))"
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/profile_decode.py --out $OUT --shape llama-8b --quant q4_k --top 14 > $OUT/prof-llama-8b-new.txt 2>&1
head -22 $OUT/prof-llama-8b-new.txt
echo "elapsed $(( $(date +%s) - T0 ))"
