#!/bin/bash
# Session 7 device run 1: Q4_K int8 GEMV, quant words split in parts (2 = new default; 1 = one 8-word tensor; 4) and bytes vs int32 words, against session 6 code; ncu SASS histograms.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1
R=$(pwd); T0=$(date +%s)
for arm in head:devruns/head new:. p1:devruns/p1 p4:devruns/p4; do
  tag=${arm%%:*}; root=${arm#*:}
  (cd $root && PYTHONPATH=/tmp/site:$([ $root = . ] && echo $R || echo $R/$root) timeout 150 python3 $R/devruns/q4k_var.py $tag) 2>&1 | grep -v Warning | tee -a $OUT/q4kvar.txt
done
echo "elapsed $(( $(date +%s) - T0 ))"
for arm in head:devruns/head new:. p1:devruns/p1; do
  tag=${arm%%:*}; root=${arm#*:}
  for lay in bytes words; do
    bash devruns/sasshist.sh $tag-$lay $([ $root = . ] && echo $R || echo $R/$root) $lay 2>&1 | tee -a $OUT/sass.txt
    cp /tmp/sass-$tag-$lay.txt /tmp/sassall/ 2>/dev/null || (mkdir -p /tmp/sassall && cp /tmp/sass-$tag-$lay.txt /tmp/sassall/)
  done
done
cd /tmp && tar czf $OUT/sass.tgz sassall q4kvar-*.json
echo "elapsed $(( $(date +%s) - T0 ))"
