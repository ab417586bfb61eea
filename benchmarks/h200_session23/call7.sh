#!/usr/bin/env bash
# session 23, call 7 (run twice: the first counted the counter against every launch, and timed out). Call 6: the flagged y's hand-off took 2.3-3.6 µs; call 3's counter was seen 0.5-0.8 µs after
# the last release, but then every warp read y from L2 (a hot spot, 1.3-1.8 µs). Now the counter with y read once
# an SM (--handoffs counter) beside the flags. Predicted: counter ahead ~6.5-7 µs a GEMV (the release fence, ~1 µs,
# stays on the path), flags ahead as call 6 (7.8); neither below the Triton launches' 6.3.
# Run as: LIMIT=200 bash benchmarks/h200_session23/call7.sh
CALL=call7 LIMIT=${LIMIT:-200}
. "$(dirname "$0")/../h200_session19/common.sh"
fits 150 chain && { timeout 150 python3 benchmarks/tile_prefetch_chain.py --trace --loaders tma --chunks-kb 8 \
  --modes gated,ahead --inflight 0,4,8 --handoffs flags,counter --json $W/chain.json > $W/chain.txt 2>&1
  log chain $?; cat $W/chain.txt | tee -a $OUT/log.txt; }
