#!/usr/bin/env bash
# session 22, call 3: issue #5's figures on the engine with the early trigger + one prefetched tile (call 2).
# Run as: LIMIT=300 bash benchmarks/h200_session22/call3.sh
CALL=call3 LIMIT=${LIMIT:-300}
. "$(dirname "$0")/../h200_session19/common.sh"
run off_new 75 "$OFF"
run res_new 25 "$RES"
run res_prof_new 50 "$RES --profile 4"
RES_EAGER="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode eager --steps 8 --warmup 2 --prefill 0"
run res_eager 45 "$RES_EAGER"
