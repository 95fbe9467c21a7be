#!/bin/bash
# Session 8 device run 7: the precompile tests on the GPU.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1; timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_precompile.py --tb=short 2>&1 | grep -v "Delay kernel" | tail -8 | tee $OUT/gpu-tests-precompile.txt
