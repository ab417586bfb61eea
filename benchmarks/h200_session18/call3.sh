#!/usr/bin/env bash
# written in session 17, ran in session 18 as device call 3 (was planned_call2.sh) on main (135e6a2) itself, with
# main's code in .carry/main_tree (see planned_call1.sh): all of tests/gpu on the branch (session 17 ran it at
# 3276ecb, before ensure's key pass moved before its wait: 722d875 ran only the ensure and offload GPU tests);
# resident decode on main; two zero-code offloaded A/Bs on main: the copy service's batches of one entry (one copy
# a call, now that an entry is one copy) and ensure at 4 warps (its victims now come from registers).
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call2.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
RES="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode graph --steps 32 --warmup 8 --prefill 0"
off() { name=$1 tree=$2; shift 2; (cd $tree && PYTHONPATH=$PWD timeout 110 python3 benchmarks/decode_variants.py "$@" -- $OFF --json $W/off_$name.json > $W/off_$name.txt 2>&1)
  rc=$?; log "$name" $rc; grep -E "achieved/bound|bandwidths after" $W/off_$name.txt | tee -a $OUT/log.txt; }
export PYTHONPATH=$PWD
timeout 340 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 tests/gpu > $W/gpu_tests_all.txt 2>&1
log tests_all $?; tail -3 $W/gpu_tests_all.txt | tee -a $OUT/log.txt
(cd .carry/main_tree && PYTHONPATH=$PWD timeout 60 python3 benchmarks/decode_variants.py -- $RES --json $W/res_main.json > $W/res_main.txt 2>&1)
log "res_main $(grep -o 'graph: [0-9.]* tok/s' $W/res_main.txt | tail -1)" $?
off group1 .carry/main_tree --copy-batch-group 1
off warps4 .carry/main_tree --ensure-warps 4
