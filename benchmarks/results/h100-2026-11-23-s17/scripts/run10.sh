python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 560 python3 benchmarks/quant_matmul.py --timing kernels --types Q4_1,Q5_0 --ms 1,16,64,2048 --time-budget 520 \
  --out $OUT/run10-Q4_1-Q5_0.json > $OUT/run10.log 2>&1
tail -5 $OUT/run10.log
echo "elapsed $(( $(date +%s) - T0 ))"
