python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py -k "wgmma" 2>&1 | tail -15
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 120 python3 devruns/q8_words.py 2>&1 | grep -v -i "warn" | grep -v "^I0000\|^W0000" | tail -30
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 280 python3 benchmarks/float_tiles.py --type Q8_0 --shapes 8b-up,8b-down,8b-gateup,8b-qkv,8b-o,1b-gateup,1b-down \
  --ms 8,16,32,64 --dequants f32,wgmma --grid none --out $OUT/run1-q8-tiles.json 2>&1 | grep -v -i "warn" | grep -v "^I0000\|^W0000" | tail -80
echo "elapsed $(( $(date +%s) - T0 ))"
