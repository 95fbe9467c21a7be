#!/bin/bash
# Session 14 device run 14: bf16x2 for Q4_0 / Q4_1 too: GPU tests, then smollm2-135m Q4_1 A/B at
# batches 8 and 32 (bf16x2 against the float32 path), and llama-1b Q4_K batch 16 once more.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py -k "bf16x2 or Q4_1 or Q4_0" --tb=short 2>&1 | tail -4
echo "elapsed $(( $(date +%s) - T0 ))"
mkdir -p /tmp/m; python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/sm.gguf -q
timeout 300 python3 benchmarks/ab.py --models /tmp/m/sm.gguf --batches 8,32 \
  --arm f32=pallas_kernels.quant_matmul.gemv:BF16X2_MAX_M=0 --rounds 2 --out $OUT/run14-ab-sm.json 2>&1 | grep -v -i warn | tail -6
echo "elapsed $(( $(date +%s) - T0 ))"
