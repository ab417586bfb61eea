#!/usr/bin/env bash
# ran in session 18 as device call 4 (its tests failed, so it stopped there; call 5 ran its benchmarks, below), on branch wip/split-listed (main + the captured offloaded step's hits' up and
# down before the listed pairs' up and down, moe_gemv.split_at_the_list; --no-split-listed restores one pass), no
# carry needed. The GPU tests it touches (stops there if they fail), then offloaded decode alternating with and
# without the split, then the copy-list profile at 50 % lru (the tail from the last byte to the last down's end,
# and now to the last up's: 16.0 us to down's end on main in call 1), then a second A/B pair while time is left.
# Run as: LIMIT=<seconds> bash benchmarks/h200_session18/planned_call4.sh
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w4; mkdir -p $W
LIMIT=${LIMIT:-340}  # seconds this call may use (the device budget left); a step starts only if its budget fits
save() { cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call4.tgz -C $W .; }  # after every step: a kill loses nothing
trap save EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; save; }
fits() { [ $(( $(date +%s) - T0 + $1 )) -le $LIMIT ] || { log "skipped_$2" -; false; }; }
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
P="--geometry qwen3-30b-a3b --context 4096 --moe-policy lru --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0 --profile 4 --moe-cache-fraction 0.5"
off() { name=$1; shift; fits 75 $name || return; timeout 100 python3 benchmarks/decode_variants.py "$@" -- $OFF --json $W/off_$name.json > $W/off_$name.txt 2>&1
  rc=$?; log "$name" $rc; grep -E "achieved/bound" $W/off_$name.txt | head -4 | tee -a $OUT/log.txt; }
prof() { name=$1; shift; fits 65 $name || return; timeout 90 python3 benchmarks/decode_variants.py "$@" -- $P --json $W/prof_$name.json > $W/prof_$name.txt 2>&1
  rc=$?; log "$name" $rc; grep -E "achieved/bound|copy lists|_down|_up" $W/prof_$name.txt | head -6 | tee -a $OUT/log.txt; }
export PYTHONPATH=$PWD
timeout 140 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 tests/gpu/test_copy_service_gpu.py \
  tests/gpu/test_streamed_experts_gpu.py tests/gpu/test_expert_offload.py tests/kernels/test_moe_gemv.py > $W/gpu_tests.txt 2>&1
rc=$?; log tests $rc; tail -3 $W/gpu_tests.txt | tee -a $OUT/log.txt
[ $rc -eq 0 ] || { grep -E "^FAILED|Error" $W/gpu_tests.txt | head -20 | tee -a $OUT/log.txt; exit 1; }
off split_1
off one_1 --no-split-listed
prof split_50
prof one_50 --no-split-listed
off split_2
off one_2 --no-split-listed
