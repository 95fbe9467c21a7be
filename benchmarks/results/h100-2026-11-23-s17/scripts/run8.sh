python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py::test_wgmma_gpu[1-64-2-2-8] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[5-64-1-1-8] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-128-8-4-8] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-192-16-8-8] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[33-64-4-2-8] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[64-128-2-1-8]  2>&1 | grep -v "^W\|^I" | tail -12
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 120 python3 benchmarks/float_tiles.py --type Q8_0 --shapes 8b-up,8b-down,8b-o,8b-kv --ms 16 --dequants wgmma --grid quad \
    --out $OUT/run8-Q8_0.json 2>&1 | grep "M=16\|error" | grep -v "^W\|^I" | cut -c1-80
echo "elapsed $(( $(date +%s) - T0 ))"
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q8_0 -o /tmp/m/l1b8.gguf -q
timeout 300 python3 benchmarks/ab.py --models /tmp/m/l1b8.gguf --batches 8,32 \
  --arm rows=pallas_kernels.quant_matmul.wgmma_skinny:QUAD_PLANES=0 --rounds 2 --out $OUT/run8-ab.json 2>&1 | grep -v -i "warn" | grep -v "^I0000\|^W0000" | tail -5
echo "elapsed $(( $(date +%s) - T0 ))"
