#!/bin/bash
# Session 7 device run 3: A/B end to end, session 6 code (bytes) against Q4_K quant planes as words; and words with producer rounding at every size.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
mkdir -p /tmp/m; python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q; python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q; el
G=pallas_kernels.quant_matmul.gemv
run() {  # model tag root patch batch
  (cd $3 && PATCH="$4" PYTHONPATH=/tmp/site:. timeout 100 python3 /work/main/devruns/bench_patch.py bench -m /tmp/m/$1.gguf --prompt-len 512 --gen 128 --batch ${5:-1} --steps-per-dispatch 16 --repeats 3 -q --json /tmp/ab-$1-$2.json > /tmp/ab-$1-$2.txt 2>&1)
  echo "$1 $2: $(head -1 /tmp/ab-$1-$2.txt | cut -c1-80) $(python3 -c "import json; print(json.load(open('/tmp/ab-$1-$2.json'))['summary'].get('tg'))" 2>&1 | tail -1)"; el
}
for i in 1 2; do run l1b head$i devruns/head ""; run l1b new$i . ""; run l1b p0-$i . "$G:INT8_PRODUCER_MIN_VALUES=0"; done
run l1b b8-head devruns/head "" 8; run l1b b8-new . "" 8
run l8b head1 devruns/head ""; run l8b new1 . ""; run l8b p0-1 . "$G:INT8_PRODUCER_MIN_VALUES=0"
cd /tmp && tar czf $OUT/run3.tgz ab-*.json ab-*.txt
