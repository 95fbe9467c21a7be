#!/bin/bash
# Session 8 device run 3: host trace of the XLA compile (which passes take the 11-15 s that do not depend on the layer count).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
[ -f /tmp/m/l8b.gguf ] || python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
python3 devruns/compile_profile.py /tmp/m/l8b.gguf 4 2>&1 | grep -v Warning | tee $OUT/compile-profile-l8b-4layers.txt
echo "elapsed $(( $(date +%s) - T0 ))"
