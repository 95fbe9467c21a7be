#!/bin/bash
# Session 6 device run 5: GPU tests of the final code; interleaved A/B (session 5 code vs this session's, and this session's with producer rounding for every size).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_rms_norm.py tests/test_int8_activations.py tests/test_quant_matmul_gpu.py tests/test_engine.py -m gpu --tb=short -k "not 300" > $OUT/gpu-tests5.txt 2>&1
grep -E "passed|failed|FAILED" $OUT/gpu-tests5.txt | head; el
mkdir -p /tmp/m; python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q; python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/smollm2.gguf -q; el
G=pallas_kernels.quant_matmul.gemv
run() {  # model tag root patch
  (cd $3 && PATCH="$4" PYTHONPATH=/tmp/site:. timeout 100 python3 /work/main/devruns/bench_patch.py bench -m /tmp/m/$1.gguf --prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 3 -q --json /tmp/ab-$1-$2.json > /tmp/ab-$1-$2.txt 2>&1)
  echo "$1 $2: $(head -1 /tmp/ab-$1-$2.txt | cut -c1-80) $(python3 -c "import json; print(json.load(open('/tmp/ab-$1-$2.json'))['summary'].get('tg'))" 2>&1 | tail -1)"; el
}
for i in 1 2; do run l1b head$i devruns/head ""; run l1b new$i . ""; run l1b p0-$i . "$G:INT8_PRODUCER_MIN_VALUES=0"; done
run l8b head1 devruns/head ""; run l8b new1 . ""; run l8b p0-1 . "$G:INT8_PRODUCER_MIN_VALUES=0"
run smollm2 head1 devruns/head ""; run smollm2 new1 . ""
cd /tmp && tar czf $OUT/run5.tgz ab-*.json ab-*.txt
