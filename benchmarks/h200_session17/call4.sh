#!/usr/bin/env bash
# session 17, device call 4, on branch wip/ensure-early (main 03821e8 + ensure's key pass before its PDL wait; merged
# as 722d875),
# main's code in .carry/main_tree: the ensure GPU tests, the copy-list profile at 50 % lru (where ensure ends and
# the first byte crosses, after the router), then offloaded decode on both trees.
#   mkdir -p .carry/main_tree && git archive main 'edgemoe/*.py' edgemoe/engine edgemoe/kernels edgemoe/layers \
#     edgemoe/models edgemoe/moe edgemoe/server benchmarks | tar -x -C .carry/main_tree
# Ran as: bash .carry/call4.sh   (carry: [".carry"])
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w4; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call4.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
P="--geometry qwen3-30b-a3b --context 4096 --moe-policy lru --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0 --profile 4 --moe-cache-fraction 0.5"
off() { name=$1 tree=$2; shift 2; (cd $tree && PYTHONPATH=$PWD timeout 100 python3 benchmarks/decode_variants.py "$@" -- $OFF --json $W/off_$name.json > $W/off_$name.txt 2>&1)
  rc=$?; log "$name" $rc; grep -E "achieved/bound|bandwidths after" $W/off_$name.txt | tee -a $OUT/log.txt; }
export PYTHONPATH=$PWD
timeout 120 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 tests/gpu/test_ensure_kernel_gpu.py \
  tests/gpu/test_expert_offload.py > $W/gpu_tests.txt 2>&1
log tests $?; tail -2 $W/gpu_tests.txt | tee -a $OUT/log.txt
timeout 90 python3 benchmarks/decode_variants.py -- $P --json $W/prof_ens_50.json > $W/prof_ens_50.txt 2>&1
log prof_ens_50 $?; grep -E "achieved/bound|copy lists|upload auto|_ensure" $W/prof_ens_50.txt | head -6 | tee -a $OUT/log.txt
off ens_1 .
off main_1 .carry/main_tree
