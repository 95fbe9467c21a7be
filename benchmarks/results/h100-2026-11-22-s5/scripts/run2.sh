#!/bin/bash
# Device run 2: A/B of session 4's code (devruns/head) against rope_append + direct decode attention; GPU tests.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
mkdir -p /tmp/m
export PYTHONPATH=/tmp/site:.
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/smollm2.gguf -q
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b-q4k.gguf -q
python3 -m rjax.cli synth llama-1b --quant q8_0 -o /tmp/m/l1b-q8.gguf -q
run() {  # model variant path batch
  PYTHONPATH=/tmp/site:$3 timeout 90 python3 -m rjax.cli bench -m /tmp/m/$1.gguf --prompt-len 512 --gen 128 --batch $4 --steps-per-dispatch 16 --repeats 3 -q --json $OUT/ab-$1-$2-b$4.json > $OUT/ab-$1-$2-b$4.txt 2>&1
  echo "$1 B=$4 $2: $(python3 -c "import json; print(json.load(open('$OUT/ab-$1-$2-b$4.json'))['summary'].get('tg'))" 2>&1 | tail -1)"; el
}
for m in smollm2 l1b-q4k; do run $m head devruns/head 1; run $m new . 1; done
run l1b-q8 head devruns/head 8; run l1b-q8 new . 8
run smollm2 head2 devruns/head 1; run smollm2 new2 . 1
timeout 60 python3 benchmarks/profile_decode.py --out $OUT --shape smollm2-135m --quant q4_1 > $OUT/prof.txt 2>&1; tail -3 $OUT/prof.txt; el
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kv_append.py tests/test_attention_gpu.py tests/test_engine.py tests/test_rms_norm.py -m gpu --tb=short -k "not 300" > $OUT/gpu-tests.txt 2>&1
grep -E "passed|failed|FAILED|Error" $OUT/gpu-tests.txt | head -20; el
cd $OUT && tar czf ab.tgz ab-*.json ab-*.txt && rm ab-*.json ab-*.txt
