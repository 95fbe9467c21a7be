#!/bin/bash
# Device run 9: longer interleaved A/B, session 4's code (devruns/head) against 1dd9d96, 5 repeats each.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
mkdir -p /tmp/m
export PYTHONPATH=/tmp/site:.
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/smollm2.gguf -q
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b-q4k.gguf -q
run() {  # model variant path
  PYTHONPATH=/tmp/site:$3 timeout 80 python3 -m rjax.cli bench -m /tmp/m/$1.gguf --prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 5 -q --json $OUT/ab-$1-$2.json > /dev/null 2>&1
  echo "$1 $2: $(python3 -c "import json; print(json.load(open('$OUT/ab-$1-$2.json'))['summary'].get('tg'))" 2>&1 | tail -1)"; el
}
for i in 1 2 3; do for m in smollm2 l1b-q4k; do run $m head$i devruns/head; run $m new$i .; done; done
cd $OUT && tar czf ab9.tgz ab-*.json && rm ab-*.json
