#!/usr/bin/env bash
# session 23, call 5. Call 4: with y's flags in the data a hand-off took 1.3 µs when nothing else was in flight
# (gated), but 4.9 µs when the producer had asked ahead for its whole 192 KB an SM (25 MB over the GPU): the
# hand-off's small reads wait behind the flood (~25 MB / 4.2 TB/s = 6 µs). Now the producer may cap its requests in
# flight (--inflight N: wait for the request N back). Predicted: ahead at 2-4 in flight 4.5-5.5 µs a GEMV (hand-off
# ~2 µs, HBM busy during it); gated unchanged (~8.8); inflight 0 as call 4.
# Run as: LIMIT=200 bash benchmarks/h200_session23/call5.sh
CALL=call5 LIMIT=${LIMIT:-200}
. "$(dirname "$0")/../h200_session19/common.sh"
fits 150 chain && { timeout 180 python3 benchmarks/tile_prefetch_chain.py --trace --modes gated,ahead --inflight 0,1,2,4,8 \
  --json $W/chain.json > $W/chain.txt 2>&1; log chain $?; cat $W/chain.txt | tee -a $OUT/log.txt; }
