python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
NCU=/usr/local/cuda/bin/ncu
timeout 150 $NCU --target-processes all -k regex:"qmatmul" -c 2 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
  python3 devruns/ncu_f.py f32,bf16x2 > $OUT/run7-ncu.txt 2>&1
grep -E "qmatmul|Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Block Limit|Stall|Issued Ipc|No Eligible|Shared Memory Configuration Size|Dynamic Shared|Waves" $OUT/run7-ncu.txt | head -80
timeout 100 $NCU --target-processes all -k regex:"qmatmul" -c 1 --section SourceCounters \
  --page source --print-source sass python3 devruns/ncu_f.py bf16x2 > $OUT/run7-sass-bf16x2.txt 2>&1
wc -l $OUT/run7-sass-bf16x2.txt
timeout 200 python3 benchmarks/float_tiles.py --shapes 8b-up --ms 16 --dequants bf16x2 --grid wide --out $OUT/run7-wide.json 2>&1 | grep -v -i "warn\|delay kernel" | tail -8
