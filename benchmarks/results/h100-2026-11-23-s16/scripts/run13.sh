python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
timeout 200 python3 benchmarks/ab.py --models /tmp/m/l1b.gguf --batches 8,32 \
  --arm noq6=pallas_kernels.quant_matmul.gemv:WGMMA_MIN_VALUES[Q6_K]=4611686018427387904 --rounds 1 --out $OUT/run13-ab.json 2>&1 | grep -v -i "warn" | grep -v "^I0000\|^W0000" | tail -5
echo "elapsed $(( $(date +%s) - T0 ))"
