#!/bin/bash
# Session 6 device run 3: int8 GEMV with per-chunk accumulators: GPU tests, SASS histogram (HEAD vs new), decode kernel times (HEAD vs new); llama-1b A/B.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_int8_gemv.py tests/test_quant_matmul_gpu.py -m gpu --tb=short -x > $OUT/gpu-tests3.txt 2>&1
grep -E "passed|failed|FAILED" $OUT/gpu-tests3.txt | head; el
bash devruns/sasshist.sh head devruns/head; bash devruns/sasshist.sh new .; el
S=28672x4096,14336x4096,4096x14336,6144x4096,4096x4096,16384x2048,2048x8192,3072x2048,2048x2048
for v in head new; do R=.; [ $v = head ] && R=devruns/head
  PYTHONPATH=/tmp/site:$R timeout 150 python3 $R/benchmarks/quant_matmul.py --mode decode --types Q4_K --shapes $S --ms 1 --timing kernels --out /tmp/qd-$v.json > /tmp/qd-$v.txt 2>&1
  echo $v; grep -E "^qmatmul|HBM copy" /tmp/qd-$v.txt | cut -c1-110; el; done
mkdir -p /tmp/m; python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
run() {  # tag root
  (cd $2 && PYTHONPATH=/tmp/site:. timeout 80 python3 -c "import rjax, sys; print(rjax.__file__, file=sys.stderr); from rjax.cli import main; sys.exit(main())" bench -m /tmp/m/l1b.gguf --prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 3 -q --json /tmp/ab-$1.json > /tmp/ab-$1.txt 2>&1)
  head -1 /tmp/ab-$1.txt
  echo "l1b $1: $(python3 -c "import json; print(json.load(open('/tmp/ab-$1.json'))['summary'].get('tg'))" 2>&1 | tail -1)"; el
}
for i in 1 2; do run head$i devruns/head; run new$i .; done
cd /tmp && tar czf $OUT/run3.tgz sass-*.short qd-*.json qd-*.txt ab-*.json
