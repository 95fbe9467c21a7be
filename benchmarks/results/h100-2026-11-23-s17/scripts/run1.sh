python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py -k wgmma 2>&1 | tail -4
echo "elapsed $(( $(date +%s) - T0 ))"
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q4_k_m -o /tmp/m/l1bm.gguf -q
timeout 330 python3 benchmarks/ab.py --models /tmp/m/l1bm.gguf --batches 1,8,32 \
  --arm noq6=pallas_kernels.quant_matmul.gemv:WGMMA_MIN_VALUES[Q6_K]=4611686018427387904 \
  --arm q6m2=pallas_kernels.quant_matmul.gemv:WGMMA_MIN_M[Q6_K]=2 --rounds 2 --out $OUT/run1-ab.json 2>&1 | grep -v -i "warn" | grep -v "^I0000\|^W0000" | tail -8
echo "elapsed $(( $(date +%s) - T0 ))"
