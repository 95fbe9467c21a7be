#!/bin/bash
# Device run 2: int8 GEMV with and without prefetch; ncu of the Q4_K int8 and Q6_K float kernels; HLO summary.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 300 python3 benchmarks/quant_matmul.py --mode int8 --timing kernels --types Q4_K,Q8_0 \
  --shapes 14336x4096,4096x14336,4096x4096,6144x4096,28672x4096 --ms 1 --int8-block-n 8,16,32 \
  --int8-warps 4 --int8-stages 1 --int8-programs 264 --int8-prefetch 0,1 --out $OUT/int8-prefetch.json \
  --time-budget 280 > /tmp/int8-prefetch.txt 2>&1
grep -A 40 "best per" /tmp/int8-prefetch.txt
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 150 /usr/local/cuda/bin/ncu --target-processes all -k regex:"int8_gemv|qmatmul" -c 3 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
  python3 devruns/ncu_gemv.py Q4_K:14336:4096 Q6_K:128256:4096 > $OUT/ncu.txt 2>&1
tail -5 $OUT/ncu.txt; grep -c "Section" $OUT/ncu.txt
echo "elapsed $(( $(date +%s) - T0 ))"
XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_module_re=.*decode_loop.*" \
  timeout 100 python3 benchmarks/profile_decode.py --shape llama-1b --quant q4_k --layers 2 --out /tmp/prof --top 80 > /tmp/prof.txt 2>&1
python3 devruns/hlo_summary.py /tmp/hlo/*decode_loop*after_optimizations.txt > $OUT/hlo-summary.txt 2>&1
tail -3 $OUT/hlo-summary.txt
cd /tmp && tar czf $OUT/misc.tgz int8-prefetch.txt prof.txt hlo/*decode_loop*after_optimizations.txt 2>/dev/null
echo "elapsed $(( $(date +%s) - T0 ))"
