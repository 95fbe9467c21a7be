#!/bin/bash
# Device run 7: GPU tests; A/B head vs new (rope_append sums the QKV partials); decode attention split count.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
mkdir -p /tmp/m
export PYTHONPATH=/tmp/site:.
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kv_append.py tests/test_engine.py tests/test_attention_gpu.py -m gpu --tb=short -k "not prefill_matches and not mosaic and not prefill_float32" > $OUT/gpu-tests.txt 2>&1
grep -E "passed|failed|FAILED|Error" $OUT/gpu-tests.txt | head -20; el
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/smollm2.gguf -q
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b-q4k.gguf -q
run() {  # model variant path entry [SPLITS]
  SPLITS=$5 PYTHONPATH=/tmp/site:$3 timeout 80 python3 $4 bench -m /tmp/m/$1.gguf --prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 3 -q --json $OUT/ab-$1-$2.json > $OUT/ab-$1-$2.txt 2>&1
  echo "$1 $2: $(python3 -c "import json; print(json.load(open('$OUT/ab-$1-$2.json'))['summary'].get('tg'))" 2>&1 | tail -1)"; el
}
for m in smollm2 l1b-q4k; do
  run $m head devruns/head "-m rjax.cli"; run $m new . "-m rjax.cli"; run $m new-one . devruns/splits.py one; run $m new-max . devruns/splits.py max
  run $m head2 devruns/head "-m rjax.cli"; run $m new2 . "-m rjax.cli"
done
timeout 50 python3 benchmarks/profile_decode.py --out /tmp/pn --shape smollm2-135m --quant q4_1 > $OUT/prof-new.txt 2>&1; head -16 $OUT/prof-new.txt
cd $OUT && tar czf ab.tgz ab-*.json ab-*.txt && rm ab-*.json ab-*.txt
