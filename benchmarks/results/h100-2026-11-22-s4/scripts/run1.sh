#!/bin/bash
# Device run 1 (session 4): GPU tests of in-kernel activation quantization, add_rms_norm and
# split-K partials; decode B=1 with the int8 kernel from 2**24 values (old threshold) and from 0.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py tests/test_rms_norm.py tests/test_engine.py -m gpu --tb=short > $OUT/gpu-tests.txt 2>&1
grep -E "passed|failed|Error|error:|assert" $OUT/gpu-tests.txt | head -30; el
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/llama-1b-q4_k.gguf -q
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/smollm2-q4_1.gguf -q
el
B="--prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 3 -q"
for m in smollm2-q4_1 llama-1b-q4_k; do
  for t in 16777216 0; do
    timeout 150 python3 -c "import sys, pallas_kernels.quant_matmul.gemv as g; g.INT8_MIN_VALUES=$t; from rjax.cli import main; sys.exit(main(sys.argv[1:]))" bench -m /tmp/m/$m.gguf $B --json $OUT/bench-$m-int8min$t.json > /tmp/b.txt 2>&1
    echo "$m int8_min=$t: $(grep -iE "decode|tokens/s" /tmp/b.txt | head -3 | tr '\n' ' ')"; el
  done
done
