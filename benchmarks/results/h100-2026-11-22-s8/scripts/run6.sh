#!/bin/bash
# Session 8 device run 6: decode attention split over more programs (least key blocks per split 4 / 2 / 1), end to end.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/s.gguf -q
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
python3 devruns/attn_splits.py /tmp/m/l8b.gguf 1 $OUT/splits-l8b.json 4,2,1,4,1 2>&1 | grep -v "Warning\|Delay"
python3 devruns/attn_splits.py /tmp/m/l1b.gguf 1,8 $OUT/splits-l1b.json 4,1,4,1 2>&1 | grep -v "Warning\|Delay"
python3 devruns/attn_splits.py /tmp/m/s.gguf 1 $OUT/splits-smollm2.json 4,1,4,1 2>&1 | grep -v "Warning\|Delay"
echo "elapsed $(( $(date +%s) - T0 ))"
