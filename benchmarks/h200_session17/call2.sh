#!/usr/bin/env bash
# written in session 16, run in session 17 as device call 2 (2026-12-01) on branch wip/offload-next at e2b0714, with main's code
# in .carry/main_tree (see call1.sh): the offloaded A/B's second round, with the one-copy layout alone
# (--down-after-up) twice; resident decode
# (which neither change should move) on both trees; and session 16's unrun resident A/B of the routed-expert
# GEMVs (MoE down at 2 stages and 64 columns, up at 64 columns)
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call2.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
RES="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode graph --steps 32 --warmup 8 --prefill 0"
off() { name=$1 tree=$2; shift 2; (cd $tree && PYTHONPATH=$PWD python3 benchmarks/decode_variants.py "$@" -- $OFF --json $W/off_$name.json > $W/off_$name.txt 2>&1)
  rc=$?; log "$name" $rc; grep -E "achieved/bound|bandwidths after" $W/off_$name.txt | tee -a $OUT/log.txt; }
res() { name=$1 tree=$2; shift 2; (cd $tree && PYTHONPATH=$PWD python3 benchmarks/decode_variants.py "$@" -- $RES --json $W/res_$name.json > $W/res_$name.txt 2>&1)
  rc=$?; log "$name $(grep -o 'graph: [0-9.]* tok/s' $W/res_$name.txt | tail -1)" $rc; }
off joined_only_1 . --down-after-up
off next_2 .
off main_2 .carry/main_tree
off joined_only_2 . --down-after-up
res main_1 .carry/main_tree
res next_1 .
res down_s2 . --down-stages 2
res down_k64 . --down-k 64
res up_k64 . --up-k 64
res next_2 .
