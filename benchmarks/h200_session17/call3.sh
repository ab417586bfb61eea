#!/usr/bin/env bash
# written in session 16, run in session 17 as device call 3 (2026-12-01) on wip/offload-next at 64393b3 (the early down reverted,
# so 'next' is the one-copy layout alone; its files here are named joined), main's code in .carry/main_tree: where each copy list's ~30 us go (`edgemoe bench --profile`'s
# copy-list line: first byte after the router, idle between copies, tail to down's end), offloaded lru at 50 %
# (main against the branch) and 25 % (the branch); then all of tests/gpu on the branch
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call3.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
P="--geometry qwen3-30b-a3b --context 4096 --moe-policy lru --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0 --profile 4"
prof() { name=$1 tree=$2 frac=$3; (cd $tree && PYTHONPATH=$PWD python3 benchmarks/decode_variants.py -- $P --moe-cache-fraction $frac --json $W/prof_$name.json > $W/prof_$name.txt 2>&1)
  rc=$?; log "$name" $rc; grep -E "achieved/bound|copy lists|upload auto" $W/prof_$name.txt | tee -a $OUT/log.txt; }
prof main_50 .carry/main_tree 0.5
prof next_50 . 0.5
prof next_25 . 0.25
export PYTHONPATH=$PWD
timeout 330 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 tests/gpu > $W/gpu_tests_all.txt 2>&1
log tests_all $?; tail -3 $W/gpu_tests_all.txt | tee -a $OUT/log.txt
