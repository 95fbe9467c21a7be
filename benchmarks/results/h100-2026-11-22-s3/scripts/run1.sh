#!/bin/bash
# Device run 1 (session 3): HLO of the decode loop, command-buffer flags, Q4_K int8 launch sweep.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
which ncu nsys; ls /usr/local/cuda/bin 2>/dev/null | tr '\n' ' '; echo
# 1. optimized HLO of a 2-layer llama-1b decode loop, and its kernel profile
XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_module_re=.*decode.*" \
  timeout 120 python3 benchmarks/profile_decode.py --shape llama-1b --quant q4_k --layers 2 --out /tmp/prof --top 60 > $OUT/prof-1b-2layers.txt 2>&1
tail -70 $OUT/prof-1b-2layers.txt
mkdir -p $OUT/hlo; ls /tmp/hlo | head -50 > $OUT/hlo/list.txt
cp /tmp/hlo/*decode*after_optimizations.txt $OUT/hlo/ 2>/dev/null; ls -la $OUT/hlo
echo "elapsed $(( $(date +%s) - T0 ))"
# 2. command buffers: smollm2 batch-1 decode under three XLA flag sets
for v in default off while; do
  case $v in
    default) F="";;
    off) F="--xla_gpu_enable_command_buffer=";;
    while) F="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1";;
  esac
  XLA_FLAGS="$F" timeout 110 python3 benchmarks/e2e.py --out /tmp/e2e-$v --models smollm2-135m:q4_1 --batch 1 \
     --steps-per-dispatch 16 --budget 75 > $OUT/e2e-$v.txt 2>&1
  echo "== $v"; tail -4 $OUT/e2e-$v.txt; cp /tmp/e2e-$v/e2e.json $OUT/e2e-$v.json 2>/dev/null
  echo "elapsed $(( $(date +%s) - T0 ))"
done
# 3. Q4_K int8 launch sweep, with what is left
LEFT=$(( 560 - ($(date +%s) - T0) ))
timeout $LEFT python3 benchmarks/quant_matmul.py --mode int8 --timing kernels --types Q4_K \
  --shapes 14336x4096,4096x14336,4096x4096 --ms 1 --int8-block-n 8,16 --int8-values 512,1024 \
  --int8-warps 2,4,8 --int8-stages 1,3 --int8-programs 264,1056 --out $OUT/q4k-sweep.json \
  --time-budget $(( LEFT - 15 )) > $OUT/q4k-sweep.txt 2>&1
grep -A 12 "best per" $OUT/q4k-sweep.txt
echo "elapsed $(( $(date +%s) - T0 ))"
