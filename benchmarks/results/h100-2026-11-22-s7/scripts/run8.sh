#!/bin/bash
# Session 7 device run 8: Q6_K output layers on word planes and the int8 GEMV: A/B against the previous commit (Q4_K words only).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
mkdir -p /tmp/m; python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q; python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q; el
run() {  # model tag root
  (cd $3 && PYTHONPATH=/tmp/site:. timeout 100 python3 /work/main/devruns/bench_patch.py bench -m /tmp/m/$1.gguf --prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 3 -q --json /tmp/ab-$1-$2.json > /tmp/ab-$1-$2.txt 2>&1)
  echo "$1 $2: $(head -1 /tmp/ab-$1-$2.txt | cut -c1-60) $(python3 -c "import json; print(json.load(open('/tmp/ab-$1-$2.json'))['summary'].get('tg'))" 2>&1 | tail -1)"; el
}
run l1b prev1 devruns/s7a; run l1b new1 .; run l1b prev2 devruns/s7a; run l1b new2 .
run l8b prev1 devruns/s7a; run l8b new1 .
cd /tmp && tar czf $OUT/run8.tgz ab-*.json ab-*.txt
