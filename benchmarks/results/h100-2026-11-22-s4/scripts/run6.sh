#!/bin/bash
# Device run 6: A/B on one machine, B=1 decode: HEAD (session 3 code, devruns/head) against the
# working tree (int8 rounding by producers / in kernel, add_rms_norm, partials), interleaved.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
mkdir -p /tmp/m
PYTHONPATH=/tmp/site:. python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/llama-1b-q4_k.gguf -q
PYTHONPATH=/tmp/site:. python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/smollm2-q4_1.gguf -q
PYTHONPATH=/tmp/site:. python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/llama-8b-q4_k.gguf -q
B="--prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 3 -q"
run() {  # model variant path
  PYTHONPATH=/tmp/site:$3 timeout 110 python3 -m rjax.cli bench -m /tmp/m/$1.gguf $B --json $OUT/ab-$1-$2.json > /tmp/b.txt 2>&1
  echo "$1 $2: $(python3 -c "import json; print(json.load(open('$OUT/ab-$1-$2.json'))['summary'].get('tg'))")"; el
}
for m in llama-8b-q4_k llama-1b-q4_k smollm2-q4_1; do
  run $m head devruns/head; run $m new .; run $m head2 devruns/head; run $m new2 .
done
cd $OUT && tar czf ab.tgz ab-*.json && rm ab-*.json
