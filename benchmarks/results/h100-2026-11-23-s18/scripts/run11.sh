#!/bin/bash
# Session 18 device run 11: the engine's GPU tests (the new float-path agreement among them) and
# the float kernel's GPU tests; output straight to a file (run 10's filtered pipe printed nothing
# when its timeout struck).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 370 python3 -m pytest -p no:cacheprovider -m gpu -v tests/test_engine.py "tests/test_quant_matmul_gpu.py::test_fused_kernel_gpu_f32" > $OUT/run11-gpu-tests.txt 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/run11-gpu-tests.txt | tail -40
echo "elapsed $(( $(date +%s) - T0 ))"
