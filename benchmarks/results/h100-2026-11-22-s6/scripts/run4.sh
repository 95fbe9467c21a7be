#!/bin/bash
# Session 6 device run 4: Q4_K int8 GEMV with one tensor per word: GPU tests, SASS histogram, decode kernel times (HEAD vs new), tile sweep; A/B llama-1b and llama-8b.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_int8_gemv.py -m gpu --tb=short -x > $OUT/gpu-tests4.txt 2>&1
grep -E "passed|failed|FAILED" $OUT/gpu-tests4.txt | head; el
bash devruns/sasshist.sh new .; el
S=28672x4096,14336x4096,4096x14336,6144x4096,4096x4096,16384x2048,2048x8192,3072x2048,2048x2048
for v in head new; do R=.; [ $v = head ] && R=devruns/head
  PYTHONPATH=/tmp/site:$R timeout 150 python3 $R/benchmarks/quant_matmul.py --mode decode --types Q4_K --shapes $S --ms 1 --timing kernels --out /tmp/qd-$v.json > /tmp/qd-$v.txt 2>&1
  echo $v; grep -E "^qmatmul|HBM copy" /tmp/qd-$v.txt | cut -c1-100; el; done
timeout 120 python3 benchmarks/quant_matmul.py --mode int8 --types Q4_K --shapes 28672x4096,4096x14336,16384x2048 --ms 1 --timing kernels --int8-block-n 8,16,32 --int8-values 512,1024,2048 --out /tmp/sweep4.json > /tmp/sweep4.txt 2>&1
grep -A12 "best per" /tmp/sweep4.txt | cut -c1-200; el
mkdir -p /tmp/m; python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q; python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q; el
run() {  # model tag root
  (cd $3 && PYTHONPATH=/tmp/site:. timeout 100 python3 -c "import rjax, sys; print(rjax.__file__, file=sys.stderr); from rjax.cli import main; sys.exit(main())" bench -m /tmp/m/$1.gguf --prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 3 -q --json /tmp/ab-$1-$2.json > /tmp/ab-$1-$2.txt 2>&1)
  echo "$1 $2: $(head -1 /tmp/ab-$1-$2.txt | cut -c1-40) $(python3 -c "import json; print(json.load(open('/tmp/ab-$1-$2.json'))['summary'].get('tg'))" 2>&1 | tail -1)"; el
}
for i in 1 2; do run l1b head$i devruns/head; run l1b new$i .; done
run l8b head1 devruns/head; run l8b new1 .
cd /tmp && tar czf $OUT/run4.tgz sass-*.short qd-*.json qd-*.txt ab-*.json sweep4.*
