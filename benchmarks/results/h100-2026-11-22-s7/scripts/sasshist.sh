#!/bin/bash
# ncu SASS listing of the first int8_gemv kernel -> instruction histogram of the loop body (most executed instructions)
# usage: sasshist.sh TAG PYTHONPATH_ROOT
NCU=/usr/local/cuda/bin/ncu
PYTHONPATH=/tmp/site:$2 timeout 100 $NCU --target-processes all -k regex:"int8_gemv" -c 1 --section SourceCounters \
  --page source --print-source sass python3 devruns/ncu_q4k.py $3 > /tmp/sass-$1.txt 2>&1
awk 'NR>14 && NF>10 {src=""; for(i=2;i<=NF;i++){ if ($i ~ /^[0-9]+$/ && i>2) break; src=src" "$i}; printf "%-70s s=%-5s e=%s\n", substr(src,1,70), $(i), $(i+3)}' /tmp/sass-$1.txt > /tmp/sass-$1.short
TOP=$(awk '{print $NF}' /tmp/sass-$1.short | sort | uniq -c | sort -rn | head -1 | awk '{print $2}')
echo "$1: loop instructions ($TOP): $(grep -c "$TOP\$" /tmp/sass-$1.short), total $(wc -l < /tmp/sass-$1.short)"
grep "$TOP\$" /tmp/sass-$1.short | awk '{print $1}' | sed 's/^@!\?P[0-9]//' | awk -F. '{print $1}' | sort | uniq -c | sort -rn | head -14 | tr '\n' ' '; echo
