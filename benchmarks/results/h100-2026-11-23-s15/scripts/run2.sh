python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 480 python3 benchmarks/ab.py --models /tmp/m/l8b.gguf,/tmp/m/l1b.gguf --batches 8,16,32 \
  --arm bf16x2=pallas_kernels.quant_matmul.gemv:WGMMA_MAX_M=0 --rounds 1 --out $OUT/run2-ab.json 2>&1 | grep -v -i "warn" | grep -v "^I0000\|^W0000" | tail -16
echo "elapsed $(( $(date +%s) - T0 ))"
