#!/bin/bash
# Session 11 device run 4: the consumer's norm scale reduced after its loop, the producer's
# residual and norm-weight lanes loaded before its loop. GPU tests; batch-1 profiles.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_int8_gemv_add_norm.py tests/test_engine.py \
  -k "add_norm or int8_decode_paths or longer_prefill" --tb=short 2>&1 | grep -v Warning | tail -40 > $OUT/gpu-tests.txt
tail -5 $OUT/gpu-tests.txt
echo "tests done $(( $(date +%s) - T0 ))"
for S in "llama-1b" "llama-8b --layers 8"; do
  timeout 150 python3 benchmarks/profile_decode.py --out $OUT --shape $S --quant q4_k --top 12 --batch 1 > $OUT/prof-${S%% *}-new.txt 2>&1
  echo "== ${S%% *}"; head -16 $OUT/prof-${S%% *}-new.txt
done
echo "elapsed $(( $(date +%s) - T0 ))"
