#!/bin/bash
# Session 9 device run 4: llama-1b profiles and A/Bs of the fused rope+attention (Q4_K) and the gated x (Q8_0).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
F=pallas_kernels.attention:FUSED_ROPE_MAX_ROWS=256
G=pallas_kernels.quant_matmul.gemv:GATED_X_MAX_M=64
P="python3 benchmarks/profile_decode.py --out $OUT --shape llama-1b --top 30"
$P --quant q4_k > $OUT/prof-l1b-q4k-base.txt 2>&1
$P --quant q4_k --tag=-fused --set $F > $OUT/prof-l1b-q4k-fused.txt 2>&1
$P --quant q8_0 > $OUT/prof-l1b-q80-base.txt 2>&1
$P --quant q8_0 --tag=-gated --set $G > $OUT/prof-l1b-q80-gated.txt 2>&1
for f in $OUT/prof-l1b-*.txt; do grep -v "Delay kernel" $f | head -16; done
echo "profiles done $(( $(date +%s) - T0 ))"
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b4.gguf -q
python3 -m rjax.cli synth llama-1b --quant q8_0 -o /tmp/m/l1b8.gguf -q
timeout 250 python3 benchmarks/ab.py --models /tmp/m/l1b4.gguf --batches 1,8 --arm fused=$F --rounds 2 --out $OUT/ab-l1b-q4k.json 2>&1 | grep -v "Delay kernel" | tail -8
timeout $(( 585 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/l1b8.gguf --batches 1,8 --arm gated=$G --arm both=$F,$G --rounds 2 --out $OUT/ab-l1b-q80.json 2>&1 | grep -v "Delay kernel" | tail -8
echo "elapsed $(( $(date +%s) - T0 ))"
