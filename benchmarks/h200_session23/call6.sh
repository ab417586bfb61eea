#!/usr/bin/env bash
# session 23, call 6. Call 5 hung at 8 KB x 1 slot a warp with 8 requests in flight: the request 8 back could sit
# in a slot already refilled, whose barrier then waits for a fill only the waiting producer can ask for. Now a
# request whose slot was refilled counts as landed. Copy engine only (cp.async by lanes was never faster).
# Predicted: ahead with 2-8 in flight 1-3 µs a GEMV faster than gated (call 5 at 16 KB: 8.5-9.3 against 9.0-11.4);
# neither below the Triton launches' 6.3 (the hand-off with flags in the data costs more than call 3's counters).
# Run as: LIMIT=200 bash benchmarks/h200_session23/call6.sh
CALL=call6 LIMIT=${LIMIT:-200}
. "$(dirname "$0")/../h200_session19/common.sh"
fits 150 chain && { timeout 150 python3 benchmarks/tile_prefetch_chain.py --trace --loaders tma --modes gated,ahead \
  --inflight 0,2,4,8 --json $W/chain.json > $W/chain.txt 2>&1; log chain $?; cat $W/chain.txt | tee -a $OUT/log.txt; }
