python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py -k "decode_matches or merged" 2>&1 | tail -5 | tee $OUT/gpu-tests.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_decode_rope_attention.py -k gpu 2>&1 | tail -5 | tee -a $OUT/gpu-tests.txt
timeout 300 python3 benchmarks/decode_attention_tiles.py --out $OUT/attn-tiles.json 2>&1 | grep -v "^{" | tail -25
