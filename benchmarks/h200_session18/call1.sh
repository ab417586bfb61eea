#!/usr/bin/env bash
# written in session 17, ran in session 18 as device call 1, on branch wip/down-prefetch (main +
# down's w2 rows asked into L2 before its wait, offloaded steps only), with main's code beside it, carried as .carry:
#   mkdir -p .carry/main_tree && git archive main 'edgemoe/*.py' edgemoe/engine edgemoe/kernels edgemoe/layers \
#     edgemoe/models edgemoe/moe edgemoe/server benchmarks | tar -x -C .carry/main_tree      (~4 MB)
# The GPU tests the branch touches (streamed experts, bitwise), the copy-list profile at 50 % lru (the tail from
# the last byte to down's end: 16.4 us on main in session 17), then offloaded decode alternating branch / main.
# Run as: bash benchmarks/h200_session17/planned_call1.sh   (carry: [".carry"])
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call1.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
P="--geometry qwen3-30b-a3b --context 4096 --moe-policy lru --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0 --profile 4 --moe-cache-fraction 0.5"
off() { name=$1 tree=$2; shift 2; (cd $tree && PYTHONPATH=$PWD timeout 110 python3 benchmarks/decode_variants.py "$@" -- $OFF --json $W/off_$name.json > $W/off_$name.txt 2>&1)
  rc=$?; log "$name" $rc; grep -E "achieved/bound|bandwidths after" $W/off_$name.txt | tee -a $OUT/log.txt; }
prof() { name=$1 tree=$2; shift 2; (cd $tree && PYTHONPATH=$PWD timeout 100 python3 benchmarks/decode_variants.py "$@" -- $P --json $W/prof_$name.json > $W/prof_$name.txt 2>&1)
  rc=$?; log "$name" $rc; grep -E "achieved/bound|copy lists|upload auto|_down|_ensure" $W/prof_$name.txt | head -6 | tee -a $OUT/log.txt; }
export PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 tests/gpu/test_streamed_experts_gpu.py \
  tests/gpu/test_expert_offload.py > $W/gpu_tests.txt 2>&1
log tests $?; tail -2 $W/gpu_tests.txt | tee -a $OUT/log.txt
prof pf_50 .
off pf_1 .
off main_1 .carry/main_tree
off pf_2 .
off main_2 .carry/main_tree
