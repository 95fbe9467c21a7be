#!/bin/bash
# Session 18 device run 6: smollm2-135m Q4_1 batch-1 profiles with the GatedX (default now)
# and with the attention capped at 4 splits; then the e2e table on this code.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 100 python3 benchmarks/profile_decode.py --shape smollm2-135m --quant q4_1 --batch 1 --top 40 --out $OUT 2>&1 | grep -v "Delay kernel" | tail -42 > $OUT/run6-prof-sm.txt
timeout 100 python3 benchmarks/profile_decode.py --shape smollm2-135m --quant q4_1 --batch 1 --top 40 --out $OUT --tag splits4 --set pallas_kernels.attention.decode:MAX_MERGED_SPLITS=4 2>&1 | grep -v "Delay kernel" | tail -42 > $OUT/run6-prof-sm-splits4.txt
head -16 $OUT/run6-prof-sm.txt $OUT/run6-prof-sm-splits4.txt
echo "elapsed $(( $(date +%s) - T0 ))"
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/e2e.py --out /tmp/e2e --budget 380 2>&1 | grep -v "Delay kernel" | tail -14 > $OUT/run6-e2e.txt
tar czf $OUT/run6-e2e.tgz -C /tmp e2e 2>/dev/null
cat $OUT/run6-e2e.txt
echo "elapsed $(( $(date +%s) - T0 ))"
