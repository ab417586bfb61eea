#!/usr/bin/env bash
# device call 4 (short): resident A/B of the attention splits past the context returning before their PDL wait,
# with 4 and 8 warps; then the paged-attention and PDL GPU tests
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
RES="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode graph --steps 32 --warmup 8 --prefill 0"
res() { name=$1; shift; python3 benchmarks/decode_variants.py "$@" -- $RES --json $W/res_$name.json > $W/res_$name.txt 2>&1
  rc=$?; log "$name $(grep -o 'graph: [0-9.]* tok/s' $W/res_$name.txt)" $rc; }
res late4_1 --attention-late-exit
res early4_1
res early8_1 --attention-warps 8
res early8s1_1 --attention-warps 8 --attention-stages 1
res early4_2
res late4_2 --attention-late-exit
python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 tests/gpu/test_paged_attention_gpu.py tests/gpu/test_pdl_gpu.py > $W/gpu_tests.txt 2>&1
log tests $?; tail -2 $W/gpu_tests.txt | tee -a $OUT/log.txt
