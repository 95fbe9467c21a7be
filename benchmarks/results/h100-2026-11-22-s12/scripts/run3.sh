#!/bin/bash
# Session 12 device run 3: smollm2 (Q4_1) with its products on the int8 GEMV (int8 from every
# size, x rounded by its producers), with and without the GLU in the gate/up product; llama-1b
# Q8_0 with the GLU in the product against the GLU pass; llama-1b Q4_K with XLA's PDL off/on.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/sm.gguf -q
python3 -m rjax.cli synth llama-1b --quant q8_0 -o /tmp/m/l1b8.gguf -q
G=pallas_kernels.quant_matmul.gemv
timeout 330 python3 benchmarks/ab.py --models /tmp/m/sm.gguf --batches 1 \
  --arm int8=$G:INT8_MIN_VALUES[Q4_1]=0,$G:INT8_PRODUCER_MIN_VALUES[Q4_1]=0 \
  --arm int8noglu=$G:INT8_MIN_VALUES[Q4_1]=0,$G:INT8_PRODUCER_MIN_VALUES[Q4_1]=0,$G:GLU_MAX_M=0 \
  --rounds 2 --out $OUT/ab-smollm2.json 2>&1 | grep -v "Delay kernel" | tail -4
echo "smollm2 done $(( $(date +%s) - T0 ))"
timeout $(( 585 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/l1b8.gguf --batches 1 \
  --arm noglu=$G:GLU_MAX_M=0 --rounds 2 --out $OUT/ab-l1b-q8.json 2>&1 | grep -v "Delay kernel" | tail -3
echo "elapsed $(( $(date +%s) - T0 ))"
