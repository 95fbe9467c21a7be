#!/bin/bash
# Session 9 device run 1: GPU tests of session 8's staged kernels and refactors, then the smollm2 A/B.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/s.gguf -q &
timeout 260 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_attention_gpu.py tests/test_kv_append.py \
  tests/test_engine.py tests/test_decode_rope_attention.py tests/test_gated_x.py tests/test_int8_gemv.py \
  tests/test_quant_matmul_gpu.py --tb=short 2>&1 | grep -v "Delay kernel" | tail -30 | tee $OUT/gpu-tests.txt
wait
echo "tests done $(( $(date +%s) - T0 ))"
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/s.gguf --batches 1,8 \
  --arm fused=pallas_kernels.attention:FUSED_ROPE_MAX_ROWS=256 \
  --arm gated=pallas_kernels.quant_matmul.gemv:GATED_X_MAX_M=64 --rounds 2 --out $OUT/ab-smollm2.json 2>&1 | grep -v "Delay kernel" | tail -20
echo "elapsed $(( $(date +%s) - T0 ))"
