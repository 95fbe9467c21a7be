set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 300 python3 benchmarks/l2_warm.py --out $OUT/l2-warm.json 2>&1 | grep -v Warning | tail -70
ls $OUT
