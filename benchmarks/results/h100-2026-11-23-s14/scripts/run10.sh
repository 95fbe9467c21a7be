python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py -k "bf16x2" --tb=short 2>&1 | tail -25
echo "elapsed $(( $(date +%s) - T0 ))"
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
timeout 260 python3 benchmarks/ab.py --models /tmp/m/l1b.gguf --batches 8,16,32 \
  --arm f32=pallas_kernels.quant_matmul.gemv:BF16X2_MAX_M=0 --rounds 1 --out $OUT/run10-ab.json 2>&1 | grep -v -i "warn" | tail -8
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 150 python3 benchmarks/float_tiles.py --shapes 8b-up,8b-down,8b-qkv,8b-o,1b-gateup --ms 8,16,32 --out $OUT/run10-float-tiles.json 2>&1 | grep -v -i "warn\|delay kernel" | grep -v "^error" | tail -50
echo "elapsed $(( $(date +%s) - T0 ))"
