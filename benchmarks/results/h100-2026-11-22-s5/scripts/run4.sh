#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 devruns/launch.py
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" python3 devruns/launch.py
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" python3 devruns/launch.py
XLA_FLAGS="--xla_gpu_enable_command_buffer=" python3 devruns/launch.py
