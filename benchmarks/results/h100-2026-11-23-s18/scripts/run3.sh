#!/bin/bash
# Session 18 device run 3: benchmarks/pending_norm.py with distinct norms per layer (run 2's
# "two kernels" arm shared one norm across its 16 layers, so it timed the product alone) and
# wider tiles.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/pending_norm.py --out $OUT/run3-pending-norm.json 2>&1 | grep -v "Delay kernel\|^W\|^I"
