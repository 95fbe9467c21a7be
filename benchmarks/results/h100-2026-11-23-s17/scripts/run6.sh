python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-8b --quant q4_0 -o /tmp/m/l8b40.gguf -q
timeout 480 python3 benchmarks/ab.py --models /tmp/m/l8b40.gguf --batches 8,32 \
  --arm off=pallas_kernels.quant_matmul.gemv:WGMMA_MIN_VALUES[Q4_0]=4611686018427387904 --rounds 1 --out $OUT/run6-ab.json 2>&1 | grep -v -i "warn" | grep -v "^I0000\|^W0000" | tail -6
echo "elapsed $(( $(date +%s) - T0 ))"
