#!/usr/bin/env bash
# planned for the next device session (written in session 16, NOT run yet): all of tests/gpu on the branch, and
# session 16's unrun resident A/B of the routed-expert GEMVs (MoE down at 2 stages and 64 columns, up at 64 columns)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call2.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
RES="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode graph --steps 32 --warmup 8 --prefill 0"
res() { name=$1; shift; python3 benchmarks/decode_variants.py "$@" -- $RES --json $W/res_$name.json > $W/res_$name.txt 2>&1
  rc=$?; log "$name $(grep -o 'graph: [0-9.]* tok/s' $W/res_$name.txt | tail -1)" $rc; }
for r in 1 2; do
  res eng_$r
  res down_s2_$r --down-stages 2
  res down_k64_$r --down-k 64
  res up_k64_$r --up-k 64
done
timeout 360 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 tests/gpu > $W/gpu_tests_all.txt 2>&1
log tests_all $?; tail -3 $W/gpu_tests_all.txt | tee -a $OUT/log.txt
