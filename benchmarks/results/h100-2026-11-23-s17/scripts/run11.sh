python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 500 python3 benchmarks/e2e.py --out /tmp/e2e --budget 380 2>&1 | grep -v -i "warn" | grep -v "^I0000\|^W0000" | tail -14
tar -czf $OUT/run11-e2e.tgz -C /tmp e2e 2>/dev/null
echo "elapsed $(( $(date +%s) - T0 ))"
