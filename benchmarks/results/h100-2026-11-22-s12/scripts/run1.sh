#!/bin/bash
# Session 12 device run 1: GPU tests of the gate/up product with the GLU applied (int8_gemv_glu)
# and of the engine's int8 decode paths; its tiles against the product + GLU pass.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_int8_gemv_glu.py tests/test_engine.py \
  -k "glu or int8_decode_paths" --tb=short 2>&1 | grep -v Warning | tail -25 | tee $OUT/gpu-tests.txt
echo "tests done $(( $(date +%s) - T0 )) s"
timeout 180 python3 benchmarks/int8_gemv_tiles.py --glu --type Q4_K --shapes 8b-gateup,1b-gateup --out $OUT/glu-q4k.json 2>&1 \
  | grep -v "Delay kernel\|Warning" | tail -14
timeout $(( 570 - ($(date +%s) - T0) )) python3 benchmarks/int8_gemv_tiles.py --glu --type Q8_0 --shapes 1b-gateup \
  --out $OUT/glu-q8.json 2>&1 | grep -v "Delay kernel\|Warning" | tail -8
echo "elapsed $(( $(date +%s) - T0 ))"
