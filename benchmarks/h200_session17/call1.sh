#!/usr/bin/env bash
# written in session 16, run in session 17 as device call 1 (2026-12-01) on branch wip/offload-next at e2b0714 (main + an
# expert in one copy + the early down), with main's code beside it, carried as .carry:
#   mkdir -p .carry/main_tree && git archive main 'edgemoe/*.py' edgemoe/engine edgemoe/kernels edgemoe/layers \
#     edgemoe/models edgemoe/moe edgemoe/server benchmarks | tar -x -C .carry/main_tree      (~4 MB)
# The copy probe (what one more copy costs), the GPU tests the branch touches, then offloaded decode: main, then
# the branch (call2.sh adds the branch with down after all of up, i.e. the one-copy layout alone).
# Run as: bash benchmarks/h200_session17/call1.sh   (carry: [".carry"])
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call1.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
off() { name=$1 tree=$2; shift 2; (cd $tree && PYTHONPATH=$PWD python3 benchmarks/decode_variants.py "$@" -- $OFF --json $W/off_$name.json > $W/off_$name.txt 2>&1)
  rc=$?; log "$name" $rc; grep -E "achieved/bound|bandwidths after" $W/off_$name.txt | tee -a $OUT/log.txt; }
export PYTHONPATH=$PWD
timeout 200 python3 benchmarks/copy_service.py --rows 1,2,8 --json $W/copy_service.json > $W/copy_service.txt 2>&1
log copy_service $?; grep -v -i warn $W/copy_service.txt | tee -a $OUT/log.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 tests/gpu/test_copy_service_gpu.py \
  tests/gpu/test_miss_copy_gpu.py tests/gpu/test_streamed_experts_gpu.py tests/gpu/test_expert_offload.py \
  tests/kernels/test_moe_gemv.py > $W/gpu_tests.txt 2>&1
log tests $?; tail -2 $W/gpu_tests.txt | tee -a $OUT/log.txt
off main_1 .carry/main_tree
off next_1 .
