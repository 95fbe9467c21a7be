set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 330 python3 benchmarks/l2_warm.py --out $OUT/l2-warm.json 2>&1 | grep -v Warning | tail -70
timeout 200 python3 benchmarks/profile_decode.py --shape llama-8b --quant q4_k --batch 1 --top 14 --out $OUT > $OUT/prof-8b-b1-32l.txt 2>&1; head -24 $OUT/prof-8b-b1-32l.txt
ls $OUT
