#!/usr/bin/env bash
# planned for the next device session (written in session 18, NOT run yet): after planned_call1.sh, on the same
# branch (wip/late-trigger), no carry. The second round of offloaded A/B runs (the engine, the 8-row up, down after
# the listed programs, down after every up program), so that each variant has two runs beside the engine's. If a
# variant wins, all of tests/gpu on the tree that would merge comes next. Run as:
#   LIMIT=400 bash benchmarks/h200_session18/planned_call2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
LIMIT=${LIMIT:-400}  # seconds this call may use; a step starts only if its budget fits
save() { cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call2.tgz -C $W .; }  # after every step: a kill loses nothing
trap save EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; save; }
fits() { [ $(( $(date +%s) - T0 + $1 )) -le $LIMIT ] || { log "skipped_$2" -; false; }; }
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
RES="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode graph --steps 32 --warmup 8 --prefill 0"
P="--geometry qwen3-30b-a3b --context 4096 --moe-policy lru --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0 --profile 4 --moe-cache-fraction 0.5"
UP8="--up-rows 8 --up-warps 4 --up-stages 8"
run() { name=$1 need=$2 args=$3; shift 3; fits $need $name || return
  timeout $(( need + 30 )) python3 benchmarks/decode_variants.py "$@" -- $args --json $W/$name.json > $W/$name.txt 2>&1
  rc=$?; log "$name" $rc; grep -E "achieved/bound|copy lists|  _up|  _down" $W/$name.txt | head -6 | tee -a $OUT/log.txt; }
run off_main_2 75 "$OFF"
run off_up8_2 75 "$OFF" $UP8
run off_late_2 75 "$OFF" --up-trigger listed-end
run off_end_1 75 "$OFF" --up-trigger end
