#!/bin/bash
# Device run 6: the Q4_K GPU tests after the prefill fix; the llama-8b decode profile with the GPU layout; kernel table.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py -k "Q4_K" --tb=short > $OUT/gpu-tests.txt 2>&1
tail -3 $OUT/gpu-tests.txt
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 150 python3 benchmarks/quant_matmul.py --mode decode --timing kernels --types Q4_K,Q8_0 \
  --shapes 14336x4096,4096x14336,4096x4096,6144x4096,28672x4096 --ms 1,16 --out $OUT/quant_matmul-decode.json > /tmp/qd.txt 2>&1
grep -E "qmatmul|xla_bf16" /tmp/qd.txt | grep -v "^\[" | tail -30; grep "HBM copy" /tmp/qd.txt
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 240 python3 benchmarks/profile_decode.py --shape llama-8b --quant q4_k --out /tmp/prof --top 25 > /tmp/prof.txt 2>&1
head -14 /tmp/prof.txt; cp /tmp/prof/*.json $OUT/ 2>/dev/null
echo "elapsed $(( $(date +%s) - T0 ))"
