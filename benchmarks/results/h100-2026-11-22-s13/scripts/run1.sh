python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,power.limit --format=csv
python3 benchmarks/pdl_chain.py --out $OUT/run1-pdl-chain.json 2>&1 | tee $OUT/run1-pdl-chain.txt
