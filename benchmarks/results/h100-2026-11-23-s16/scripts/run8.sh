python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
for T in Q4_K Q8_0; do
  timeout 250 python3 benchmarks/float_tiles.py --type $T --shapes 8b-o,8b-qkv,1b-down,1b-gateup --ms 16 --dequants wgmma --grid small \
    --out $OUT/run8-$T.json 2>&1 | grep -v "^W\|^I\|arn"
  echo "elapsed $(( $(date +%s) - T0 ))"
done
