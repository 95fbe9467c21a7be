#!/bin/bash
# Session 18 device run 7: decode wall time per token against the layer count (layers.py), and
# the kernel time of a 6-layer smollm2 step, to split a token into per-layer and per-step time.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
timeout 100 python3 benchmarks/profile_decode.py --shape smollm2-135m --quant q4_1 --batch 1 --layers 6 --top 12 --out $OUT 2>&1 | grep -v "Delay kernel" | tail -14 > $OUT/run7-prof-sm-6.txt
head -3 $OUT/run7-prof-sm-6.txt
timeout 100 python3 benchmarks/profile_decode.py --shape llama-1b --quant q4_k --batch 1 --top 20 --out $OUT 2>&1 | grep -v "Delay kernel" | tail -22 > $OUT/run7-prof-1b.txt
head -3 $OUT/run7-prof-1b.txt
echo "elapsed $(( $(date +%s) - T0 ))"
timeout $(( 590 - ($(date +%s) - T0) )) python3 devruns/layers.py 2>&1 | grep -v "Delay kernel" | tail -9 > $OUT/run7-layers.txt
cat $OUT/run7-layers.txt | head -8
echo "elapsed $(( $(date +%s) - T0 ))"
