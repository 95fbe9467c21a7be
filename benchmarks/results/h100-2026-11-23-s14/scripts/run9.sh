python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_quant_matmul_gpu.py -k "bf16x2 or Q4_K" 2>&1 | tail -4
echo "elapsed $(( $(date +%s) - T0 ))"
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 400 python3 benchmarks/ab.py --models /tmp/m/l8b.gguf --batches 8,16,32 \
  --arm f32=pallas_kernels.quant_matmul.gemv:BF16X2_MAX_M=0 --rounds 2 --out $OUT/run9-ab.json 2>&1 | grep -v -i "warn" | tail -14
echo "elapsed $(( $(date +%s) - T0 ))"
