#!/bin/bash
# Session 8 device run 1: where the compile time goes (trace / lower / XLA compile), with and without autotuning.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/s.gguf -q
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
echo "synth $(( $(date +%s) - T0 ))"
python3 devruns/compile_breakdown.py /tmp/m/s.gguf smollm2 $OUT/cb-smollm2.json 2>&1 | grep -v Warning
python3 devruns/compile_breakdown.py /tmp/m/l8b.gguf l8b $OUT/cb-l8b.json 2>&1 | grep -v Warning
XLA_FLAGS=--xla_gpu_autotune_level=0 python3 devruns/compile_breakdown.py /tmp/m/l8b.gguf l8b-noautotune $OUT/cb-l8b-noat.json 2>&1 | grep -v Warning
echo "elapsed $(( $(date +%s) - T0 ))"
