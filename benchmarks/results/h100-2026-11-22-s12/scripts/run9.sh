#!/bin/bash
# Session 12 device run 9: GPU tests of the final code: the GLU product with its final tiles, the
# engine's int8 decode paths (GLU in the product as a variant), Q6_K (scales as words), add+norm.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_int8_gemv_glu.py tests/test_int8_gemv_add_norm.py \
  tests/test_engine.py tests/test_quant_matmul_gpu.py -k "glu or add_norm or int8_decode_paths or Q6_K or matches_longer" \
  --tb=short 2>&1 | grep -v Warning | tail -8 | tee $OUT/gpu-tests.txt
