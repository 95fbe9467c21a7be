#!/bin/bash
# Session 11 device run 3: GPU tests of the fused residual add + norm in the int8 GEMV; batch-1
# profiles with it (default) and without (ADD_NORM_MAX_M=0).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_int8_gemv_add_norm.py tests/test_engine.py \
  -k "add_norm or int8_decode_paths or longer_prefill" 2>&1 | tail -15 | tee $OUT/gpu-tests.txt
echo "tests done $(( $(date +%s) - T0 ))"
OFF="--set pallas_kernels.quant_matmul.gemv:ADD_NORM_MAX_M=0 --tag=-off"
for S in "llama-1b" "llama-8b --layers 8"; do
  timeout 150 python3 benchmarks/profile_decode.py --out $OUT --shape $S --quant q4_k --top 12 --batch 1 > $OUT/prof-${S%% *}-new.txt 2>&1
  timeout 150 python3 benchmarks/profile_decode.py --out $OUT --shape $S --quant q4_k --top 12 --batch 1 $OFF > $OUT/prof-${S%% *}-off.txt 2>&1
  for f in new off; do echo "== ${S%% *} $f"; head -16 $OUT/prof-${S%% *}-$f.txt; done
done
echo "elapsed $(( $(date +%s) - T0 ))"
