#!/bin/bash
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/m; python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/smollm2.gguf -q
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_loop.*" timeout 120 python3 -m rjax.cli bench -m /tmp/m/smollm2.gguf --prompt-len 512 --gen 64 --batch 1 --steps-per-dispatch 16 --repeats 1 -q > /dev/null 2>&1
ls /tmp/dump | head -30
f=$(ls /tmp/dump/*decode_loop*after_optimizations.txt | head -1); echo $f
grep -c "command_buffer" $f; grep -o "calls=%command_buffer[^,]*" $f | head -3
cp $f $OUT/after_opt.txt; ls /tmp/dump/*decode_loop*thunk* 2>/dev/null | head; cp /tmp/dump/*decode_loop*thunk_sequence* $OUT/ 2>/dev/null
cd $OUT && gzip after_opt.txt
