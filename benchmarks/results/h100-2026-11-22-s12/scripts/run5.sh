#!/bin/bash
# Session 12 device run 5: Q6_K's 16 scales read as 4 words (the GPU layout now): GPU tests of
# the int8 GEMV and the float kernel on Q6_K, and the output layers' tiles again (run 4: bytes).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_quant_matmul_gpu.py -k "Q6_K" --tb=short 2>&1 \
  | grep -v Warning | tail -6 | tee $OUT/gpu-tests.txt
echo "tests done $(( $(date +%s) - T0 )) s"
timeout $(( 560 - ($(date +%s) - T0) )) python3 benchmarks/int8_gemv_tiles.py --type Q6_K --shapes 8b-out,1b-out \
  --out $OUT/q6k-out-words.json 2>&1 | grep -v "Delay kernel\|Warning" | tail -11
echo "elapsed $(( $(date +%s) - T0 ))"
