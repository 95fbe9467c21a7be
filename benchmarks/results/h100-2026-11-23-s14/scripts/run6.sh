python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
python3 devruns/dbg_tile.py 2>&1 | grep -v Warn | tail -12
timeout 300 python3 benchmarks/float_tiles.py --shapes 8b-up,8b-down,8b-qkv --ms 4,16 --out $OUT/run6-float-tiles.json 2>&1 | grep -v -i "warn\|delay kernel" | tail -40
