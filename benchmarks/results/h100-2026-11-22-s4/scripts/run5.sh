#!/bin/bash
# Device run 5: GPU tests (int8 GEMV on raw x and on QuantizedX); B=1 decode with producer-side
# rounding from 0 / 2**25 / never (INT8_PRODUCER_MIN_VALUES) on llama-1b Q4_K, Q8_0 and llama-8b Q4_K.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py tests/test_rms_norm.py tests/test_int8_activations.py tests/test_engine.py -m gpu --tb=short -k "not 300" > $OUT/gpu-tests.txt 2>&1
grep -E "passed|failed|Error|error:|assert" $OUT/gpu-tests.txt | head -20; el
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/llama-1b-q4_k.gguf -q
python3 -m rjax.cli synth llama-1b --quant q8_0 -o /tmp/m/llama-1b-q8_0.gguf -q
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/llama-8b-q4_k.gguf -q
B="--prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 3 -q"
run() {  # model producer-threshold
  timeout 120 python3 -c "import sys, pallas_kernels.quant_matmul.gemv as g; g.INT8_PRODUCER_MIN_VALUES=$2; from rjax.cli import main; sys.exit(main(sys.argv[1:]))" bench -m /tmp/m/$1.gguf $B --json $OUT/bench-$1-prod$2.json > /tmp/b.txt 2>&1
  echo "$1 producer>=$2: $(python3 -c "import json; print(json.load(open('$OUT/bench-$1-prod$2.json'))['summary'].get('tg'))")"; el
}
for t in 33554432 0 1099511627776; do run llama-1b-q4_k $t; done
for t in 33554432 1099511627776; do run llama-1b-q8_0 $t; done
for t in 33554432 0 1099511627776; do run llama-8b-q4_k $t; done
