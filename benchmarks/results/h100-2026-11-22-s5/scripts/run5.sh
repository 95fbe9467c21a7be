#!/bin/bash
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1
for s in "smollm2-135m q4_1" "llama-1b q4_k"; do set -- $s
  for v in head new; do
    d=.; [ $v = head ] && d=devruns/head
    rm -rf /tmp/p-$v-$1; PYTHONPATH=/tmp/site:$d timeout 80 python3 $d/benchmarks/profile_decode.py --out /tmp/p-$v-$1 --shape $1 --quant $2 > $OUT/prof-$v-$1.txt 2>&1
    echo "$v: $(head -1 $OUT/prof-$v-$1.txt)"
  done
done
