#!/bin/bash
# Session 10 device run 8: llama-8b profiles, this session's code against session 9's (devruns/base),
# to find what the A/B of run 7 lost at batch 1 and 8.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
P="--shape llama-8b --quant q4_k --top 12 --layers 8"
python3 benchmarks/profile_decode.py --out $OUT $P --batch 8 > $OUT/prof-8b-b8-new.txt 2>&1
python3 devruns/base/benchmarks/profile_decode.py --out $OUT $P --batch 8 --tag=-base > $OUT/prof-8b-b8-base.txt 2>&1
python3 benchmarks/profile_decode.py --out $OUT $P --batch 8 --tag=-split2 --set pallas_kernels.attention.decode:MAX_MERGED_SPLITS=2 > $OUT/prof-8b-b8-split2.txt 2>&1
python3 benchmarks/profile_decode.py --out $OUT $P --batch 1 > $OUT/prof-8b-b1-new.txt 2>&1
python3 devruns/base/benchmarks/profile_decode.py --out $OUT $P --batch 1 --tag=-base > $OUT/prof-8b-b1-base.txt 2>&1
for f in b8-new b8-base b8-split2 b1-new b1-base; do echo "== $f"; head -16 $OUT/prof-8b-$f.txt; done
echo "elapsed $(( $(date +%s) - T0 ))"
