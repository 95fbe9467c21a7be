python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
for T in Q8_0 Q4_K; do
  timeout 200 python3 benchmarks/float_tiles.py --type $T --shapes 8b-up,8b-down,8b-o,8b-kv,8b-qkv,8b-gateup,1b-gateup,1b-down --ms 16 --dequants wgmma --grid none \
    --out $OUT/run9-$T.json 2>&1 | grep "M=" | grep -v "^W\|^I"
  echo "elapsed $(( $(date +%s) - T0 ))"
done
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q8_0 -o /tmp/m/l1b8.gguf -q
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
timeout 300 python3 benchmarks/ab.py --models /tmp/m/l1b8.gguf,/tmp/m/l1b.gguf --batches 8,32 \
  --arm p264=pallas_kernels.quant_matmul.wgmma_skinny:PROGRAMS=264 --rounds 1 --out $OUT/run9-ab.json 2>&1 | grep -v -i "warn" | grep -v "^I0000\|^W0000" | tail -7
echo "elapsed $(( $(date +%s) - T0 ))"
