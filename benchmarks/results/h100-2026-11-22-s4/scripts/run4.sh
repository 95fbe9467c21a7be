#!/bin/bash
# Device run 4: GPU tests (producer-side int8 rounding: add_rms_norm_q8, quantize_rows, GLU);
# llama-1b profile; B=1 decode for llama-1b Q4_K, Q8_0, smollm2 Q4_1 (int8 from 0 and 2**24), llama-8b Q4_K.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py tests/test_rms_norm.py tests/test_int8_activations.py tests/test_engine.py -m gpu --tb=short -k "not 300" > $OUT/gpu-tests.txt 2>&1
grep -E "passed|failed|Error|error:|assert" $OUT/gpu-tests.txt | head -30; el
timeout 100 python3 benchmarks/profile_decode.py --out $OUT/prof-llama-1b --shape llama-1b --quant q4_k > $OUT/prof-llama-1b.txt 2>&1; head -24 $OUT/prof-llama-1b.txt; el
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q8_0 -o /tmp/m/llama-1b-q8_0.gguf -q
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/llama-1b-q4_k.gguf -q
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/smollm2-q4_1.gguf -q
B="--prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 3 -q"
run() {  # model type threshold
  timeout 150 python3 -c "import sys, pallas_kernels.quant_matmul.gemv as g; from gguf import GGMLQuantizationType as Q; g.INT8_MIN_VALUES[Q.$2]=$3; from rjax.cli import main; sys.exit(main(sys.argv[1:]))" bench -m /tmp/m/$1.gguf $B --json $OUT/bench-$1-$2min$3.json > /tmp/b.txt 2>&1
  echo "$1 $2 min=$3: $(python3 -c "import json; print(json.load(open('$OUT/bench-$1-$2min$3.json'))['summary'].get('tg'))")"; el
}
run llama-1b-q4_k Q4_K 0
run llama-1b-q8_0 Q8_0 0
run smollm2-q4_1 Q4_1 0
run smollm2-q4_1 Q4_1 16777216
python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/llama-8b-q4_k.gguf -q; el
run llama-8b-q4_k Q4_K 0
