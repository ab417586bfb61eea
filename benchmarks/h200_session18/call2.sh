#!/usr/bin/env bash
# written in session 17, ran in session 18 as device call 2 (was planned_call3.sh), on branch wip/direct-first (main + up
# reading a one-token list's first gate_up rows from the pinned bank itself while the copy service copies the rest):
# the GPU tests it touches, the copy-list profile at 50 % lru (its first byte is the copy engine's, which this does
# not move: the SMs' reads are not in the trace; the step and the tail are what to read), then offloaded decode
# alternating with `--no-direct-first` (the same tree, main's behaviour).
# Run as: bash benchmarks/h200_session17/planned_call3.sh   (no carry needed)
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w3; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call3.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
P="--geometry qwen3-30b-a3b --context 4096 --moe-policy lru --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0 --profile 4 --moe-cache-fraction 0.5"
export PYTHONPATH=$PWD
off() { name=$1; shift; timeout 110 python3 benchmarks/decode_variants.py "$@" -- $OFF --json $W/off_$name.json > $W/off_$name.txt 2>&1
  rc=$?; log "$name" $rc; grep -E "achieved/bound|bandwidths after" $W/off_$name.txt | tee -a $OUT/log.txt; }
timeout 200 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 tests/gpu/test_copy_service_gpu.py \
  tests/gpu/test_expert_offload.py tests/gpu/test_streamed_experts_gpu.py tests/kernels/test_moe_gemv.py > $W/gpu_tests.txt 2>&1
log tests $?; tail -2 $W/gpu_tests.txt | tee -a $OUT/log.txt
timeout 100 python3 benchmarks/decode_variants.py -- $P --json $W/prof_direct_50.json > $W/prof_direct_50.txt 2>&1
log prof_direct_50 $?; grep -E "achieved/bound|copy lists|upload auto" $W/prof_direct_50.txt | head -4 | tee -a $OUT/log.txt
off direct_1
off plain_1 --no-direct-first
off direct_2
off plain_2 --no-direct-first
