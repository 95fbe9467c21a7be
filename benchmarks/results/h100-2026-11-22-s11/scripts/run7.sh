#!/bin/bash
# Session 11 device run 7: as run 6, the rounding done on the merged rows (bytes packed by a sum over 4 contiguous values, no lane loads). The one-token attention hands its output to the int8 output
# projection rounded to int8 (QUANTIZED_ATTENTION_OUT). GPU tests; a llama-8b profile; A/B at
# batch 1 against QUANTIZED_ATTENTION_OUT=0 (llama-8b, llama-1b Q4_K).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode_rope_attention.py tests/test_engine.py \
  -k "two_kernels or int8_decode_paths" --tb=short 2>&1 | grep -v Warning | tail -30 > $OUT/gpu-tests.txt
tail -3 $OUT/gpu-tests.txt; echo "tests done $(( $(date +%s) - T0 ))"
timeout 120 python3 benchmarks/profile_decode.py --out $OUT --shape llama-8b --layers 8 --quant q4_k --top 12 --batch 1 > $OUT/prof-llama-8b-new.txt 2>&1
head -16 $OUT/prof-llama-8b-new.txt
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
echo "synth done $(( $(date +%s) - T0 ))"
timeout $(( 585 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/l8b.gguf,/tmp/m/l1b.gguf \
  --batches 1 --arm off=pallas_kernels.quant_matmul.gemv:QUANTIZED_ATTENTION_OUT=0 --rounds 2 --out $OUT/ab.json 2>&1 \
  | grep -v "Delay kernel" | tail -8
echo "elapsed $(( $(date +%s) - T0 ))"
