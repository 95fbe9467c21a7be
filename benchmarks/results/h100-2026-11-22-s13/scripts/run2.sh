#!/bin/bash
# Session 13 device run 2: the decode loop's while loop as a CUDA graph (WHILE and CONDITIONAL in
# XLA's command buffers) against the default, batch 1, llama-1b Q4_K and smollm2-135m Q4_1.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/sm.gguf -q
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/l1b.gguf,/tmp/m/sm.gguf \
  --batches 1 --arm "graph=xla:$CB" --rounds 2 --out $OUT/run2-ab-while-graph.json 2>&1 | grep -v "Delay kernel" | tail -8
echo "elapsed $(( $(date +%s) - T0 ))"
