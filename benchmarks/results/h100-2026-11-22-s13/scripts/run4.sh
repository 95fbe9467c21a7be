#!/bin/bash
# Session 13 device run 4: profiles at batch 1 with the decode loop as one CUDA graph (every
# kernel listed), llama-1b Q4_K and smollm2-135m Q4_1.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
python3 benchmarks/profile_decode.py --shape llama-1b --quant q4_k --batch 1 --top 60 --out $OUT 2>&1 | grep -v "Delay kernel" | tail -62 > $OUT/run4-prof-1b.txt
python3 benchmarks/profile_decode.py --shape smollm2-135m --quant q4_1 --batch 1 --top 60 --out $OUT 2>&1 | grep -v "Delay kernel" | tail -62 > $OUT/run4-prof-sm.txt
head -8 $OUT/run4-prof-1b.txt $OUT/run4-prof-sm.txt
echo "elapsed $(( $(date +%s) - T0 ))"
