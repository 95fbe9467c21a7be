python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py::test_wgmma_gpu[1-64-2-2-2] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[1-64-2-2-3] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[1-64-2-2-6] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[5-64-1-1-2] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[5-64-1-1-3] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[5-64-1-1-6] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-128-8-4-2] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-128-8-4-3] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-128-8-4-6] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-192-16-8-2] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-192-16-8-3] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-192-16-8-6] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[33-64-4-2-2] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[33-64-4-2-3] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[33-64-4-2-6] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[64-128-2-1-2] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[64-128-2-1-3] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[64-128-2-1-6]  2>&1 | tail -3
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 420 python3 benchmarks/quant_matmul.py --timing kernels --types Q4_K,Q8_0 --ms 1,16,64,2048 --time-budget 380 \
  --out $OUT/run3-Q4_K-Q8_0.json > $OUT/run3.log 2>&1
tail -5 $OUT/run3.log
echo "elapsed $(( $(date +%s) - T0 ))"
