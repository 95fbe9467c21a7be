#!/bin/bash
# Session 7 device run 5: llama-1b batch 4 (Q4_K int8 GEMV up to M=4 now) against session 6's code; the issue 7 table on the final code (benchmarks/e2e.py).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m; python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
for arm in head:devruns/head new:.; do tag=${arm%%:*}; root=${arm#*:}
  (cd $root && PYTHONPATH=/tmp/site:. timeout 60 python3 /work/main/devruns/bench_patch.py bench -m /tmp/m/l1b.gguf --prompt-len 512 --gen 128 --batch 4 --steps-per-dispatch 16 --repeats 3 -q --json /tmp/b4-$tag.json > /tmp/b4-$tag.txt 2>&1)
  echo "b4 $tag: $(head -1 /tmp/b4-$tag.txt | cut -c1-60) $(python3 -c "import json; print(json.load(open('/tmp/b4-$tag.json'))['summary']['decode_by_batch'])" 2>&1 | tail -1)"
done
cp /tmp/b4-*.json $OUT/; rm -f /tmp/m/l1b.gguf
echo "elapsed $(( $(date +%s) - T0 ))"
timeout 490 python3 benchmarks/e2e.py --out /tmp/e2e --budget $(( 575 - $(date +%s) + T0 )) > /tmp/e2e.txt 2>&1
grep -B2 -A 10 "^model " /tmp/e2e.txt | tail -14
cd /tmp/e2e && tar czf $OUT/e2e.tgz *.json *.png 2>/dev/null; cp /tmp/e2e.txt $OUT/
echo "elapsed $(( $(date +%s) - T0 ))"
