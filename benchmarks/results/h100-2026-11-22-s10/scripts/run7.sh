#!/bin/bash
# Session 10 device run 7: A/B of this session's code (HEAD) against session 9's (devruns/base, 1193286).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
timeout $(( 585 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/l8b.gguf,/tmp/m/l1b.gguf --batches 1,8 \
  --arm s9=@devruns/base --rounds 2 --out $OUT/ab.json 2>&1 | grep -v "Delay kernel" | tail -14
echo "elapsed $(( $(date +%s) - T0 ))"
