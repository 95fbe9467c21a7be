#!/bin/bash
# Session 10 device run 3: GPU tests of the in-register rope prologue and the in-kernel split merge,
# then profiles and an A/B (base: HEAD 1193286 in devruns/base) at batch 1.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/s.gguf -q &
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q &
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode_rope_attention.py tests/test_attention_gpu.py \
  -k "gpu or merged or decode_matches" --tb=short 2>&1 | grep -v "Delay kernel\|Deprecat\|return rule\|^$" | tail -30 | tee $OUT/gpu-tests.txt
wait
echo "tests done $(( $(date +%s) - T0 ))"
for shape in "smollm2-135m q4_1" "llama-1b q4_k"; do
  set -- $shape
  python3 benchmarks/profile_decode.py --out $OUT --shape $1 --quant $2 --top 12 > $OUT/prof-$1-new.txt 2>&1
  python3 devruns/base/benchmarks/profile_decode.py --out $OUT --shape $1 --quant $2 --top 12 --tag=-base > $OUT/prof-$1-base.txt 2>&1
  head -14 $OUT/prof-$1-new.txt; head -14 $OUT/prof-$1-base.txt
done
echo "profiles done $(( $(date +%s) - T0 ))"
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/s.gguf,/tmp/m/l1b.gguf --batches 1 \
  --arm s9=@devruns/base --rounds 1 --out $OUT/ab.json 2>&1 | grep -v "Delay kernel" | tail -12
echo "elapsed $(( $(date +%s) - T0 ))"
