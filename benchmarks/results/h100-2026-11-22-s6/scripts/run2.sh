#!/bin/bash
# Session 6 device run 2: GPU tests of the chunked norm/rounding kernels; llama-1b profiles per chunk size; llama-8b profile; ncu SASS of the Q4_K int8 GEMV.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_rms_norm.py tests/test_int8_activations.py -m gpu --tb=short > $OUT/gpu-tests.txt 2>&1
grep -E "passed|failed|FAILED" $OUT/gpu-tests.txt | head; el
M=pallas_kernels.int8_activations.kernel
for cw in 8:2 16:2 32:2 16:1 16:4; do cg=${cw%:*}; w=${cw#*:}; for _ in 1; do
  PATCH="$M:CHUNK_GROUPS=$cg,$M:CHUNK_WARPS=$w" timeout 90 python3 devruns/prof_patch.py --out /tmp/p1-$cg-$w --shape llama-1b --quant q4_k > /tmp/prof-1b-$cg-$w.txt 2>&1
  echo "cg=$cg w=$w: $(grep -E 'us/step in' /tmp/prof-1b-$cg-$w.txt)"; grep -E "add_rms_norm|quantize|loop_multiply" /tmp/prof-1b-$cg-$w.txt
done; done; el
timeout 150 python3 benchmarks/profile_decode.py --out /tmp/p8 --shape llama-8b --quant q4_k > /tmp/prof-8b.txt 2>&1; head -20 /tmp/prof-8b.txt; el
NCU=/usr/local/cuda/bin/ncu; [ -x $NCU ] || NCU=$(find / -name ncu -type f 2>/dev/null | head -1)
timeout 120 $NCU --target-processes all -k regex:"int8_gemv" -c 1 --set full --import-source no \
  python3 devruns/ncu_q4k.py > /tmp/ncu-details.txt 2>&1; tail -3 /tmp/ncu-details.txt; el
timeout 120 $NCU --target-processes all -k regex:"int8_gemv" -c 1 --section SourceCounters --section WarpStateStats \
  --page source --print-source sass python3 devruns/ncu_q4k.py > /tmp/ncu-sass.txt 2>&1; wc -l /tmp/ncu-sass.txt; tail -3 /tmp/ncu-sass.txt; el
cd /tmp && tar czf $OUT/run2.tgz prof-*.txt ncu-details.txt ncu-sass.txt; ls -la $OUT
