#!/usr/bin/env bash
# sourced by this folder's callN.sh (written in session 18): the shared set-up, after CALL=<name>.
# Outputs go to /tmp/$CALL (one folder a call: a second call on the same machine does not pack the first's) and
# are packed into $OUT/$CALL.tgz after every step, so a kill loses nothing; a step starts only if its time fits
# LIMIT (the device seconds the call may use).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s)
W=/tmp/$CALL; mkdir -p $W
LIMIT=${LIMIT:-400}
save() { cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/$CALL.tgz -C $W .; }  # after every step: a kill loses nothing
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
gpu_tests() { limit=$1; shift  # the GPU tests a call touches, within $limit seconds; the call stops if they fail
  timeout $limit python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 "$@" > $W/gpu_tests.txt 2>&1
  rc=$?; log tests $rc; tail -2 $W/gpu_tests.txt | tee -a $OUT/log.txt
  [ $rc -eq 0 ] || { grep -E "^FAILED|Error" $W/gpu_tests.txt | head -20 | tee -a $OUT/log.txt; exit 1; }; }
