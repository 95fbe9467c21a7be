#!/bin/bash
# Device run 2: where llama-1b and smollm2 decode steps go now (profile); the int8 size
# threshold for Q8_0 (llama-1b) and Q4_1 (smollm2, 2**20); llama-8b Q4_K batch 1.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
timeout 120 python3 benchmarks/profile_decode.py --out $OUT/prof-llama-1b --shape llama-1b --quant q4_k > $OUT/prof-llama-1b.txt 2>&1; tail -30 $OUT/prof-llama-1b.txt; el
timeout 100 python3 benchmarks/profile_decode.py --out $OUT/prof-smollm2 --shape smollm2-135m --quant q4_1 > $OUT/prof-smollm2.txt 2>&1; tail -22 $OUT/prof-smollm2.txt; el
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q8_0 -o /tmp/m/llama-1b-q8_0.gguf -q
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/smollm2-q4_1.gguf -q
B="--prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 3 -q"
run() {  # model type threshold
  timeout 150 python3 -c "import sys, pallas_kernels.quant_matmul.gemv as g; from gguf import GGMLQuantizationType as Q; g.INT8_MIN_VALUES[Q.$2]=$3; from rjax.cli import main; sys.exit(main(sys.argv[1:]))" bench -m /tmp/m/$1.gguf $B --json $OUT/bench-$1-$2min$3.json > /tmp/b.txt 2>&1
  echo "$1 $2 min=$3: $(python3 -c "import json; print(json.load(open('$OUT/bench-$1-$2min$3.json'))['summary'].get('tg'))")"; el
}
run llama-1b-q8_0 Q8_0 16777216
run llama-1b-q8_0 Q8_0 0
run smollm2-q4_1 Q4_1 1048576
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/llama-8b-q4_k.gguf -q; el
run llama-8b-q4_k Q4_K 0
