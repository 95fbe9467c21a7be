python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
for T in Q8_0 Q4_K; do
  D=wgmma; [ $T = Q4_K ] && D=bf16x2,wgmma
  timeout 250 python3 benchmarks/float_tiles.py --type $T --shapes 8b-up,8b-down,8b-o,8b-kv --ms 16 --dequants $D --grid none \
    --out $OUT/run7-$T.json 2>&1 | grep "M=" | grep -v "^W\|^I"
  echo "elapsed $(( $(date +%s) - T0 ))"
done
