#!/usr/bin/env bash
# session 23, call 9: call 8's hand-offs again, now also beside 264 blocks that load HBM until the rounds are done
# (--loaders 0,264). Predicted: idle as call 8 (cluster 0.74, flags 1.1-1.2, counter 1.5); loaded: cluster ~0.8-1.0
# (its data moves SM to SM, not through L2), flags and counter 2-4 µs (as the chain's hand-offs ahead); loaders
# 3.5-4 TB/s.
# Run as: LIMIT=120 bash benchmarks/h200_session23/call9.sh
CALL=call9 LIMIT=${LIMIT:-120}
. "$(dirname "$0")/../h200_session19/common.sh"
fits 60 handoff && { timeout 90 python3 benchmarks/handoff_latency.py --json $W/handoff.json > $W/handoff.txt 2>&1
  log handoff $?; cat $W/handoff.txt | tee -a $OUT/log.txt; }
