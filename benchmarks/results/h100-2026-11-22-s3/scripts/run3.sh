#!/bin/bash
# Device run 3: Q4_K int8 with chunk scales vs packed; decode-attention splits A/B end to end.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 200 python3 benchmarks/quant_matmul.py --mode int8 --timing kernels --types Q4_K \
  --shapes 14336x4096,4096x14336,4096x4096,6144x4096,28672x4096 --ms 1 --int8-block-n 8,16 --int8-values 512,1024 \
  --int8-warps 4 --int8-stages 1 --int8-programs 264 --int8-prefetch 0,1 --out $OUT/q4k-chunk.json \
  --time-budget 190 > /tmp/q4k-chunk.txt 2>&1
grep -A 16 "best per" /tmp/q4k-chunk.txt
echo "elapsed $(( $(date +%s) - T0 ))"
e2e() {  # tag models
  timeout 150 python3 benchmarks/e2e.py --out /tmp/e2e-$1 --models $2 --batch 1 --steps-per-dispatch 16 --budget 100 > /tmp/e2e-$1.txt 2>&1
  echo "== $1"; grep -E "^(smollm2|llama)" /tmp/e2e-$1.txt; cp /tmp/e2e-$1/e2e.json $OUT/e2e-$1.json 2>/dev/null
}
e2e A1 smollm2-135m:q4_1,llama-1b:q4_k
sed -i 's|num_keys // (4 \* block_k)|num_keys // block_k|' pallas_kernels/attention/decode.py
grep -n "num_keys // " pallas_kernels/attention/decode.py
e2e B1 smollm2-135m:q4_1,llama-1b:q4_k
git checkout pallas_kernels/attention/decode.py 2>/dev/null || sed -i 's|num_keys // block_k)|num_keys // (4 * block_k))|' pallas_kernels/attention/decode.py
grep -n "num_keys // " pallas_kernels/attention/decode.py
e2e A2 smollm2-135m:q4_1
sed -i 's|num_keys // (4 \* block_k)|num_keys // block_k|' pallas_kernels/attention/decode.py
e2e B2 smollm2-135m:q4_1
echo "elapsed $(( $(date +%s) - T0 ))"
