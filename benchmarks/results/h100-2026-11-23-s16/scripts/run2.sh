python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q8_0 -o /tmp/m/l1b8.gguf -q
echo "elapsed $(( $(date +%s) - T0 ))"
G=pallas_kernels.quant_matmul.gemv
# (code then: WGMMA_MIN_VALUES[Q8_0] = WORDS_MIN_VALUES[Q8_0] = 2**24)
timeout 540 python3 benchmarks/ab.py --models /tmp/m/l1b8.gguf --batches 1,8,32 \
  --arm off=$G:WGMMA_MIN_VALUES[Q8_0]=4611686018427387904 --arm bytes=$G:WORDS_MIN_VALUES[Q8_0]=4611686018427387904 \
  --arm all=$G:WGMMA_MIN_VALUES[Q8_0]=0 \
  --rounds 1 --out $OUT/run2-ab.json 2>&1 | grep -v -i "warn" | grep -v "^I0000\|^W0000" | tail -16
echo "elapsed $(( $(date +%s) - T0 ))"
