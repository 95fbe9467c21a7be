#!/bin/bash
# Session 9 device run 2: the GPU tests run 1 did not reach, then profiles of base / fused / gated.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 250 python3 -m pytest -p no:cacheprovider -m gpu tests/test_attention_gpu.py tests/test_int8_gemv.py \
  tests/test_quant_matmul_gpu.py tests/test_decode_rope_attention.py tests/test_gated_x.py --tb=short -rfE -v 2>&1 \
  | grep -v "Delay kernel" > /tmp/t.txt; grep -c PASSED /tmp/t.txt; grep -v PASSED /tmp/t.txt | tail -40 | tee $OUT/gpu-tests2.txt
cp /tmp/t.txt $OUT/gpu-tests2-full.txt
echo "tests done $(( $(date +%s) - T0 ))"
for shape in "smollm2-135m q4_1" "llama-1b q4_k"; do
  set -- $shape
  python3 benchmarks/profile_decode.py --out $OUT --shape $1 --quant $2 --top 30 > $OUT/prof-$1-base.txt 2>&1
  python3 benchmarks/profile_decode.py --out $OUT --shape $1 --quant $2 --top 30 --tag -fused --set pallas_kernels.attention:FUSED_ROPE_MAX_ROWS=256 > $OUT/prof-$1-fused.txt 2>&1
  python3 benchmarks/profile_decode.py --out $OUT --shape $1 --quant $2 --top 30 --tag -gated --set pallas_kernels.quant_matmul.gemv:GATED_X_MAX_M=64 > $OUT/prof-$1-gated.txt 2>&1
  for f in $OUT/prof-$1-*.txt; do grep -v "Delay kernel" $f | head -12; done
  echo "$1 done $(( $(date +%s) - T0 ))"
done
