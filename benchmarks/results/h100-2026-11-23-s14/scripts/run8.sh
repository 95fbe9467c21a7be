python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/float_tiles.py --shapes 8b-up,8b-down --ms 16 --dequants bf16x2 --grid large --out $OUT/run8-m16-large.json 2>&1 | grep -v -i "warn\|delay kernel" | tail -8
timeout 330 python3 benchmarks/float_tiles.py --shapes 8b-up,8b-down,8b-qkv,8b-o,8b-gateup,1b-gateup,1b-qkv,1b-down --ms 8,16,32 --grid wide --out $OUT/run8-float-tiles.json 2>&1 | grep -v -i "warn\|delay kernel" | tail -100
