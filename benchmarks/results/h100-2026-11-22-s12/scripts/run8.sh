#!/bin/bash
# Session 12 device run 8: where a batch-1 token goes now (all 32 llama-8b layers; llama-1b Q4_K),
# with GPU clocks before and after.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv
timeout 200 python3 benchmarks/profile_decode.py --shape llama-8b --quant q4_k --batch 1 --top 12 --out $OUT > $OUT/prof-8b-b1-32l.txt 2>&1; head -20 $OUT/prof-8b-b1-32l.txt
timeout 150 python3 benchmarks/profile_decode.py --shape llama-1b --quant q4_k --batch 1 --top 12 --out $OUT > $OUT/prof-1b-b1.txt 2>&1; head -20 $OUT/prof-1b-b1.txt
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
