#!/bin/bash
# Device run 3: GPU tests of the new kernels; A/B with and without XLA command buffers; llama-1b profile.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
mkdir -p /tmp/m
export PYTHONPATH=/tmp/site:.
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_kv_append.py tests/test_attention_gpu.py tests/test_engine.py -m gpu --tb=short -k "not prefill_matches and not mosaic and not prefill_float32" > $OUT/gpu-tests.txt 2>&1
grep -E "passed|failed|FAILED|Error" $OUT/gpu-tests.txt | head -20; el
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/smollm2.gguf -q
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b-q4k.gguf -q
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
run() {  # model variant path flags
  XLA_FLAGS="$4" PYTHONPATH=/tmp/site:$3 timeout 80 python3 -m rjax.cli bench -m /tmp/m/$1.gguf --prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 3 -q --json $OUT/ab-$1-$2.json > $OUT/ab-$1-$2.txt 2>&1
  echo "$1 $2: $(python3 -c "import json; print(json.load(open('$OUT/ab-$1-$2.json'))['summary'].get('tg'))" 2>&1 | tail -1)"; el
}
run smollm2 new . ""; run smollm2 new-cb . "$CB"; run smollm2 head-cb devruns/head "$CB"
run l1b-q4k new . ""; run l1b-q4k head devruns/head ""; run l1b-q4k new-cb . "$CB"; run l1b-q4k head-cb devruns/head "$CB"
timeout 60 python3 benchmarks/profile_decode.py --out $OUT --shape llama-1b --quant q4_k > $OUT/prof.txt 2>&1; el
XLA_FLAGS="$CB" timeout 60 python3 benchmarks/profile_decode.py --out /tmp/pcb --shape smollm2-135m --quant q4_1 > $OUT/prof-cb.txt 2>&1; el
rm -rf $OUT/trace
cd $OUT && tar czf ab.tgz ab-*.json ab-*.txt && rm ab-*.json ab-*.txt
