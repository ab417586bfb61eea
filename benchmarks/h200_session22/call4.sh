#!/usr/bin/env bash
# session 22, call 4: is call 3's eager figure (18.5 tok/s against session 21's 39.7) the new defaults or the host?
# Eager decode alternated with main's settings. Run as: LIMIT=200 bash benchmarks/h200_session22/call4.sh
CALL=call4 LIMIT=${LIMIT:-200}
. "$(dirname "$0")/../h200_session19/common.sh"
RES_EAGER="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode eager --steps 8 --warmup 2 --prefill 0"
for i in 1 2; do
  run eager_main_$i 40 "$RES_EAGER" --no-prologue-early-trigger --attention-prefetch-tiles 0
  run eager_new_$i 40 "$RES_EAGER"
done
nproc; uptime
