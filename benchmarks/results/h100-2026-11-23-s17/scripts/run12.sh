python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1
T0=$(date +%s)
rm -rf /tmp/old && mkdir /tmp/old && cp -r pallas_kernels rjax benchmarks /tmp/old/ && cp devruns/wgmma_skinny_old.py /tmp/old/pallas_kernels/quant_matmul/wgmma_skinny.py
PYTHONPATH=/tmp/site:. timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py::test_wgmma_gpu[1-64-2-2-14] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[5-64-1-1-14] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-128-8-4-14] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[16-192-16-8-14] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[33-64-4-2-14] tests/test_quant_matmul_gpu.py::test_wgmma_gpu[64-128-2-1-14]  2>&1 | grep -v "^W\|^I" | tail -3
echo "elapsed $(( $(date +%s) - T0 ))"
for TREE in . /tmp/old; do
  (cd $TREE && PYTHONPATH=/tmp/site:. timeout 120 python3 benchmarks/float_tiles.py --type Q6_K --shapes 8b-up,8b-down,8b-o,8b-kv --ms 1,16 --dequants wgmma --grid none \
    --out $OUT/run12-$(basename $TREE).json 2>&1 | grep "M=1 \|M=16\|error" | grep -v "^W\|^I" | sort -u | cut -c1-70)
  echo "elapsed $(( $(date +%s) - T0 ))"
done
