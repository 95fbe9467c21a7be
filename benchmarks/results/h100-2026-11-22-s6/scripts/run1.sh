#!/bin/bash
# Session 6 device run 1: PTX of the Q4_K int8 GEMV; llama-8b decode profile; Q4_K int8 tile sweep at llama-1b shapes.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 120 python3 devruns/ptx.py > $OUT/ptx.txt 2>&1; tail -5 $OUT/ptx.txt; el
PTXAS=$(find / -name ptxas -type f 2>/dev/null | head -1); echo "ptxas: $PTXAS"
mkdir -p /tmp/ptx; cp /tmp/xdump/*.ptx /tmp/ptx/ 2>/dev/null; ls /tmp/xdump | head -30 > $OUT/dumpfiles.txt; ls /tmp/xdump | wc -l
for f in /tmp/ptx/*.ptx; do grep -l int8_gemv $f; done > /tmp/ptx/with_gemv.txt
for f in $(cat /tmp/ptx/with_gemv.txt); do [ -n "$PTXAS" ] && $PTXAS -arch=sm_90 -v $f -o /tmp/ptx/$(basename $f).cubin > /tmp/ptx/$(basename $f).ptxas.txt 2>&1; done
NVDIS=$(find / -name nvdisasm -type f 2>/dev/null | head -1); echo "nvdisasm: $NVDIS"
CUOBJ=$(find / -name cuobjdump -type f 2>/dev/null | head -1); echo "cuobjdump: $CUOBJ"
for c in /tmp/ptx/*.cubin; do [ -n "$CUOBJ" ] && $CUOBJ -sass $c > $c.sass 2>&1; [ -n "$NVDIS" ] && $NVDIS -c $c > $c.nvdis 2>&1; done
(cd /tmp && tar czf $OUT/ptx.tgz ptx xdump/*.txt 2>/dev/null); ls -la $OUT; el
timeout 240 python3 benchmarks/profile_decode.py --out /tmp/p8 --shape llama-8b --quant q4_k > $OUT/prof-llama-8b.txt 2>&1; head -40 $OUT/prof-llama-8b.txt; el
timeout 200 python3 benchmarks/quant_matmul.py --mode int8 --types Q4_K --shapes 16384x2048,2048x8192,3072x2048,2048x2048 --ms 1 --timing kernels --int8-block-n 4,8,16 --int8-values 512,1024,2048 --int8-warps 2,4 --int8-programs 264,528 --out $OUT/int8-sweep-1b.json > $OUT/int8-sweep-1b.txt 2>&1; tail -30 $OUT/int8-sweep-1b.txt; el
