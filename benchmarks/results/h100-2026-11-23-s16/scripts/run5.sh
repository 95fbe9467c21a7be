python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 540 python3 -m pytest -q -p no:cacheprovider -x tests/test_quant_matmul_gpu.py tests/test_int8_mma.py tests/test_int8_gemv_glu.py tests/test_float_glu.py tests/test_int8_gemv_add_norm.py tests/test_gated_x.py tests/test_engine.py 2>&1 | tail -8
echo "elapsed $(( $(date +%s) - T0 ))"
