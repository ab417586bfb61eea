#!/usr/bin/env bash
# session 23, call 8: what one hand-off of a 768-wide vector costs: a cluster barrier of 8 blocks with distributed
# shared memory, against the flags and the counter across 128 blocks (benchmarks/handoff_latency.py; nothing else in
# flight). Predicted: cluster ~0.3-0.6 µs a round; flags ~1.3-2; counter ~1.5-2.5.
# Run as: LIMIT=120 bash benchmarks/h200_session23/call8.sh
CALL=call8 LIMIT=${LIMIT:-120}
. "$(dirname "$0")/../h200_session19/common.sh"
fits 60 handoff && { timeout 90 python3 benchmarks/handoff_latency.py --json $W/handoff.json > $W/handoff.txt 2>&1
  log handoff $?; cat $W/handoff.txt | tee -a $OUT/log.txt; }
fits 40 handoff64 && { timeout 60 python3 benchmarks/handoff_latency.py --blocks 64 --json $W/handoff64.json \
  > $W/handoff64.txt 2>&1; log handoff64 $?; cat $W/handoff64.txt | tee -a $OUT/log.txt; }
