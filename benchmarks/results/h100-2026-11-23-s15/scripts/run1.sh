python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py -k "wgmma or bf16x2 or bf16" 2>&1 | tail -6
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 330 python3 benchmarks/float_tiles.py --shapes 8b-up,8b-down,8b-gateup,8b-qkv,8b-o,1b-gateup,1b-qkv,1b-down \
  --ms 8,16,32,64 --dequants bf16x2,wgmma --grid none --out $OUT/run1-tiles.json 2>&1 | grep -v -i "warn" | grep -v "^I0000\|^W0000" | tail -80
echo "elapsed $(( $(date +%s) - T0 ))"
