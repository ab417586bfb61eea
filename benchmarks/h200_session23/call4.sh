#!/usr/bin/env bash
# session 23, call 4. Call 3's trace: a hand-off costs ~5 µs of round trips (a release fence ~1.5, the counter seen
# ~0.6, y from L2 by every warp of every SM ~1.5: a hot spot), more than a GEMV's bytes take. Now y carries its own
# flags (64-bit entries {tag, bf16}: no counter, fence or release) and is read once an SM. Predicted: the hand-off
# ~1.5-2 µs; ahead 4.5-5 µs a GEMV (0.8-0.88 of HBM) at the deepest slots, gated ~6.
# Run as: LIMIT=200 bash benchmarks/h200_session23/call4.sh
CALL=call4 LIMIT=${LIMIT:-200}
. "$(dirname "$0")/../h200_session19/common.sh"
fits 120 chain && { timeout 150 python3 benchmarks/tile_prefetch_chain.py --trace --json $W/chain.json > $W/chain.txt 2>&1
  log chain $?; cat $W/chain.txt | tee -a $OUT/log.txt; }
