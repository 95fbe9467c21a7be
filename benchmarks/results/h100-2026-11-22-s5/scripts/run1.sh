#!/bin/bash
# Device run 1 (session 5): GPU tests on HEAD; smollm2 decode with XLA command buffers (WHILE) and a fixed-trip loop.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py tests/test_rms_norm.py tests/test_int8_activations.py tests/test_engine.py -m gpu --tb=short -k "not 300" > $OUT/gpu-tests.txt 2>&1
grep -E "passed|failed|FAILED" $OUT/gpu-tests.txt | head -20; el
mkdir -p /tmp/m
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/smollm2.gguf -q
B="--prompt-len 512 --gen 128 --batch 1 --steps-per-dispatch 16 --repeats 3 -q"
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
run() {  # name xla_flags entry
  XLA_FLAGS="$2" timeout 85 python3 $3 bench -m /tmp/m/smollm2.gguf $B --json $OUT/s-$1.json > $OUT/s-$1.txt 2>&1
  echo "$1: $(python3 -c "import json; print(json.load(open('$OUT/s-$1.json'))['summary'].get('tg'))" 2>&1 | tail -1)"; el
}
run default "" "-m rjax.cli"
run cmdbuf "$CB" "-m rjax.cli"
run fixed "" devruns/fixed.py
run fixed-cmdbuf "$CB" devruns/fixed.py
tail -5 $OUT/s-cmdbuf.txt
cd $OUT && tar czf s.tgz s-*.json s-*.txt && rm s-*.json s-*.txt
