#!/bin/bash
# Session 14 device run 13: batch 1 and 8, this tree against session 13's (6cf6943), llama-1b Q4_K.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/m; python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
timeout 400 python3 benchmarks/ab.py --models /tmp/m/l1b.gguf --batches 1,8 --arm s13=@devruns/prev \
  --rounds 2 --out $OUT/run13-ab.json 2>&1 | grep -v -i warn | tail -8
