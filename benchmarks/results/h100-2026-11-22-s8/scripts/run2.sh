#!/bin/bash
# Session 8 device run 2: compile time against layer count; XLA compile parallelism (the flag is gone from this XLA: the run stopped there); Triton prefill attention instead of Mosaic.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
[ -f /tmp/m/l8b.gguf ] || python3 -m rjax.cli synth llama-8b --quant q4_k -o /tmp/m/l8b.gguf -q
python3 devruns/compile_layers.py /tmp/m/l8b.gguf base $OUT/cl-base.json 2>&1 | grep -v Warning
XLA_FLAGS="--xla_gpu_enable_llvm_module_compilation_parallelism=true --xla_gpu_force_compilation_parallelism=16" python3 devruns/compile_layers.py /tmp/m/l8b.gguf par16 $OUT/cl-par16.json 2>&1 | grep -v Warning
python3 devruns/compile_layers.py /tmp/m/l8b.gguf nomgpu $OUT/cl-nomgpu.json 2>&1 | grep -v Warning
echo "elapsed $(( $(date +%s) - T0 ))"
