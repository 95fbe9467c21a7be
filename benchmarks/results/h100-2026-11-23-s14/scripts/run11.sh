python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py -k "bf16x2" --tb=short 2>&1 | tail -5
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 200 python3 benchmarks/float_tiles.py --shapes 8b-up,8b-down,8b-qkv,1b-gateup --ms 8,16,32 --grid none --out $OUT/run11-float-tiles.json 2>&1 | grep -v -i "warn\|delay kernel" | grep -v "^error" | tail -50
echo "elapsed $(( $(date +%s) - T0 ))"
