#!/usr/bin/env bash
# session 16, device call 1: the 3-stage dense GEMV default under its GPU tests; MoE up at 3 and 2 stages in
# resident decode (alternating, two runs each); offloaded with the default; then all of tests/gpu
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call1.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
RES="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode graph --steps 32 --warmup 8 --prefill 0"
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
res() { name=$1; shift; python3 benchmarks/decode_variants.py "$@" -- $RES --json $W/res_$name.json > $W/res_$name.txt 2>&1
  rc=$?; log "$name $(grep -o 'graph: [0-9.]* tok/s' $W/res_$name.txt | tail -1) $(grep -o 'bandwidths after.*' $W/res_$name.txt)" $rc; }
off() { name=$1; shift; python3 benchmarks/decode_variants.py "$@" -- $OFF --json $W/off_$name.json > $W/off_$name.txt 2>&1
  rc=$?; log "$name" $rc; grep -E "achieved/bound|bandwidths after" $W/off_$name.txt | tee -a $OUT/log.txt; }
timeout 150 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 tests/gpu/test_dense_gemv_gpu.py \
  tests/gpu/test_norm_gemv_gpu.py > $W/gemv_tests.txt 2>&1
log gemv_tests $?; tail -2 $W/gemv_tests.txt | tee -a $OUT/log.txt
for r in 1 2; do
  res eng_$r
  res up3_$r --up-stages 3
  res up2_$r --up-stages 2
done
off eng_1
timeout 330 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 tests/gpu > $W/gpu_tests.txt 2>&1
log tests $?; tail -3 $W/gpu_tests.txt | tee -a $OUT/log.txt
