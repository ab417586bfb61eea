#!/usr/bin/env bash
# session 22, call 2: the early trigger + one prefetched tile as the engine's defaults (call 1: +0.7 %), against
# main's settings, one-tile splits (the prefetched tile is then the whole split) and two pipeline stages; then all of
# tests/gpu on the new defaults. Run as: LIMIT=570 bash benchmarks/h200_session22/call2.sh
CALL=call2 LIMIT=${LIMIT:-570}
. "$(dirname "$0")/../h200_session19/common.sh"
for i in 1 2; do
  run res_main_$i 25 "$RES" --no-prologue-early-trigger --attention-prefetch-tiles 0
  run res_new_$i 25 "$RES"
  run res_new_mt1_$i 25 "$RES" --attention-min-tiles 1
  run res_new_st2_$i 25 "$RES" --attention-stages 2
done
gpu_tests 380 tests/gpu
