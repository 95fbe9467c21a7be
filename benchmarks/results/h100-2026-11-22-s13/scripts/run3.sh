#!/bin/bash
# Session 13 device run 3: decode_loop compiled with WHILE/CONDITIONAL command buffers: the engine's
# decode-loop tests on the GPU (early stop at a stop token and a full cache, int8 paths, decode
# against a longer prefill), then llama-8b A/B against session 12's code (devruns/prev = d32fee2).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py \
  -k "decode_loop or int8_decode_paths or matches_longer" --tb=short 2>&1 | grep -v Warning | tail -5 | tee $OUT/run3-gpu-tests.txt
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/l8b.gguf \
  --batches 1,8 --arm s12=@devruns/prev --rounds 2 --out $OUT/run3-ab-l8b.json 2>&1 | grep -v "Delay kernel" | tail -6
echo "elapsed $(( $(date +%s) - T0 ))"
