#!/bin/bash
# Session 18 device run 9: every GPU test on the final code.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 570 python3 -m pytest -q -p no:cacheprovider -m gpu tests -x 2>&1 | grep -v "Delay kernel" | tail -15 | tee $OUT/run9-gpu-tests.txt
echo "elapsed $(( $(date +%s) - T0 ))"
