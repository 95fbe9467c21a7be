python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py -k "wgmma and (Q4_0 or Q4_1 or Q5_0)" 2>&1 | tail -15
echo "elapsed $(( $(date +%s) - T0 ))"
for T in Q5_0 Q4_0 Q4_1; do
  DQ=f32,bf16x2,wgmma; [ $T = Q5_0 ] && DQ=f32,wgmma
  timeout 150 python3 benchmarks/float_tiles.py --type $T --shapes 8b-up,8b-down,8b-o,8b-kv --ms 1,16 --dequants $DQ --grid none \
    --out $OUT/run2-$T.json 2>&1 | grep "M=\|error" | grep -v "^W\|^I"
  echo "elapsed $(( $(date +%s) - T0 ))"
done
