#!/bin/bash
# Session 8 device run 4: the 9 bench programs of llama-8b compiled serially against concurrently (threads).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
[ -f /tmp/m/l8b.gguf ] || python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
python3 devruns/compile_parallel.py /tmp/m/l8b.gguf 9 $OUT/cp-par9.json 2>&1 | grep -v Warning
python3 devruns/compile_parallel.py /tmp/m/l8b.gguf 1 $OUT/cp-seq.json 2>&1 | grep -v Warning
echo "elapsed $(( $(date +%s) - T0 ))"
