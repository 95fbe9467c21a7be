#!/bin/bash
# Device run 9: GPU tests on the final tree; A/B repeats (session 3 code vs this tree, same machine).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
PYTHONPATH=/tmp/site:. timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py tests/test_rms_norm.py tests/test_int8_activations.py tests/test_engine.py tests/test_int8_gemv.py -m gpu --tb=short -k "not 300" > $OUT/gpu-tests.txt 2>&1
grep -E "passed|failed|Error|error:|assert|FAILED" $OUT/gpu-tests.txt | head -20; el
mkdir -p /tmp/m
PYTHONPATH=/tmp/site:. python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/smollm2-q4_1.gguf -q
PYTHONPATH=/tmp/site:. python3 -m rjax.cli synth llama-1b --quant q8_0 -o /tmp/m/llama-1b-q8_0.gguf -q
B="--prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 3 -q"
run() {  # model variant path
  PYTHONPATH=/tmp/site:$3 timeout 100 python3 -m rjax.cli bench -m /tmp/m/$1.gguf $B --json $OUT/ab-$1-$2.json > /tmp/b.txt 2>&1
  echo "$1 $2: $(python3 -c "import json; print(json.load(open('$OUT/ab-$1-$2.json'))['summary'].get('tg'))")"; el
}
for m in smollm2-q4_1 llama-1b-q8_0; do
  run $m head devruns/head; run $m new .; run $m head2 devruns/head; run $m new2 .
done
cd $OUT && tar czf ab9.tgz ab-*.json && rm ab-*.json
