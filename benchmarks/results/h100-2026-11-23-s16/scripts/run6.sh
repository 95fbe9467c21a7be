python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/test_int8_mma.py tests/test_int8_gemv_glu.py tests/test_float_glu.py tests/test_int8_gemv_add_norm.py tests/test_gated_x.py tests/test_engine.py -k "Q8_0 or q8_0" 2>&1 | tail -4
echo "elapsed $(( $(date +%s) - T0 ))"
mkdir -p /tmp/m
python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
timeout 330 python3 benchmarks/ab.py --models /tmp/m/l1b.gguf --batches 1,8 \
  --arm s15=@devruns/s15src --rounds 2 --out $OUT/run6-ab.json 2>&1 | grep -v -i "warn" | grep -v "^I0000\|^W0000" | tail -10
echo "elapsed $(( $(date +%s) - T0 ))"
