#!/bin/bash
# Session 10 device run 9: one wave of merged attention splits, the narrow Q4_K tiles only where
# K <= 2048 < N; llama-8b profiles (8 layers) and the A/B against session 9's code (devruns/base).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
P="--shape llama-8b --quant q4_k --top 8 --layers 8"
python3 benchmarks/profile_decode.py --out $OUT $P --batch 8 > $OUT/prof-8b-b8-new.txt 2>&1
python3 benchmarks/profile_decode.py --out $OUT $P --batch 1 > $OUT/prof-8b-b1-new.txt 2>&1
for f in b8-new b1-new; do echo "== $f"; head -12 $OUT/prof-8b-$f.txt; done
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
echo "synth done $(( $(date +%s) - T0 ))"
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/l8b.gguf,/tmp/m/l1b.gguf --batches 1,8 \
  --arm s9=@devruns/base --rounds 2 --out $OUT/ab.json 2>&1 | grep -v "Delay kernel" | tail -12
echo "elapsed $(( $(date +%s) - T0 ))"
