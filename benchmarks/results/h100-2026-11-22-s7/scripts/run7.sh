#!/bin/bash
# Session 7 device run 7: Q6_K output layer (128256 x 4096 / 2048): float kernel against the int8 GEMV on bytes and on words.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
timeout 280 python3 devruns/q6k.py 2>&1 | grep -v Warn | tee $OUT/q6k.txt
