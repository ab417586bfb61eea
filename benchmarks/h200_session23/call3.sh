#!/usr/bin/env bash
# session 23, call 3. Call 2 crashed at 2 stages (an mbarrier's phase parity aliased: warps took slots out of order)
# and streamed at 0.58 of HBM even with no waits. Now each warp owns its slots (one reader a slot, in order), the
# producer can load by the copy engine (tma) or by 16-byte cp.async from 32 lanes (lanes), chunks of 16 or 8 KB,
# and --trace stamps one launch. Predicted: lanes streams at >= 0.8 of HBM if the copy engine's per-SM rate was the
# limit (tma stays ~0.6); ahead within ~0.5 µs of streaming; gated ~1.5-2 µs a GEMV slower than ahead.
# Run as: LIMIT=200 bash benchmarks/h200_session23/call3.sh
CALL=call3 LIMIT=${LIMIT:-200}
. "$(dirname "$0")/../h200_session19/common.sh"
fits 120 chain && { timeout 150 python3 benchmarks/tile_prefetch_chain.py --trace --json $W/chain.json > $W/chain.txt 2>&1
  log chain $?; cat $W/chain.txt | tee -a $OUT/log.txt; }
