#!/bin/bash
# Session 10 device run 4: GPU tests with the arrival counts carried in the KV cache; profiles;
# A/B against HEAD 1193286 (devruns/base) at batch 1; the attention tiles of the new kernel.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/s.gguf -q &
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q &
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode_rope_attention.py tests/test_attention_gpu.py tests/test_engine.py \
  -k "gpu_matches or merged or decode_matches or test_engine" -m gpu -rfE --tb=short 2>&1 | grep -v "Delay kernel\|Deprecat\|return rule\|^$" | tail -8 | tee $OUT/gpu-tests.txt
wait
echo "tests done $(( $(date +%s) - T0 ))"
for shape in "smollm2-135m q4_1" "llama-1b q4_k"; do
  set -- $shape
  python3 benchmarks/profile_decode.py --out $OUT --shape $1 --quant $2 --top 12 > $OUT/prof-$1-new.txt 2>&1
  head -9 $OUT/prof-$1-new.txt
done
echo "profiles done $(( $(date +%s) - T0 ))"
timeout $(( 500 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/s.gguf,/tmp/m/l1b.gguf --batches 1,8 \
  --arm s9=@devruns/base --rounds 1 --out $OUT/ab.json 2>&1 | grep -v "Delay kernel" | tail -8
echo "ab done $(( $(date +%s) - T0 ))"
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/decode_attention_tiles.py --out $OUT/attn-tiles.json 2>&1 | grep -v "^{" | tail -22
echo "elapsed $(( $(date +%s) - T0 ))"
