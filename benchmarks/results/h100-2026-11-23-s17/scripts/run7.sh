python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py::test_wgmma_gpu[1-64-2-2-2] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[1-64-2-2-3] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[1-64-2-2-6] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[5-64-1-1-2] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[5-64-1-1-3] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[5-64-1-1-6] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-128-8-4-2] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-128-8-4-3] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-128-8-4-6] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-192-16-8-2] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-192-16-8-3] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-192-16-8-6] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[33-64-4-2-2] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[33-64-4-2-3] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[33-64-4-2-6] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[64-128-2-1-2] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[64-128-2-1-3] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[64-128-2-1-6]  2>&1 | grep -v "^W\|^I" | tail -12
echo "elapsed $(( $(date +%s) - T0 ))"
for T in Q4_1 Q5_0 Q4_0; do
  timeout 120 python3 benchmarks/float_tiles.py --type $T --shapes 8b-up,8b-down,8b-o,8b-kv --ms 16 --dequants wgmma --grid quad \
    --out $OUT/run7-$T.json 2>&1 | grep "M=16\|error" | grep -v "^W\|^I" | cut -c1-80
  echo "elapsed $(( $(date +%s) - T0 ))"
done
