python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
# (GPU tests of the first try of this run: 15 passed)
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 240 python3 benchmarks/float_tiles.py --type Q6_K --shapes 8b-down,8b-o,8b-kv,1b-down,8b-out --ms 16,64 --dequants f32,wgmma --grid none \
    --out $OUT/run11-Q6_K.json 2>&1 | grep "M=\|rror" | grep -v "^W\|^I"
echo "elapsed $(( $(date +%s) - T0 ))"
