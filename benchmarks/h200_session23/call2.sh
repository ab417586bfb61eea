#!/usr/bin/env bash
# session 23, call 2 (call 1 found the first kernel streaming at 0.60 of HBM, its consumers the bottleneck): does streaming the next GEMV's weights into shared memory ahead of its input close a chain's gap
# to HBM? benchmarks/tile_prefetch_chain.py (CUDA C++, built by nvcc) against the engine's launches and session 20's
# Triton static kernel, 8 GEMVs of 16.8 MB. Predicted (µs a GEMV, 3.9 at HBM): launches ~6.3-6.6 (one build) /
# ~8.8 (two), static ~6.3, now a warp a chunk, y in registers, a release a warp: streaming ~4.3-4.6 (0.85-0.9), ahead at 12 stages ~4.5-5, gated ~6.
# Run as: LIMIT=200 bash benchmarks/h200_session23/call2.sh
CALL=call2 LIMIT=${LIMIT:-200}
. "$(dirname "$0")/../h200_session19/common.sh"
fits 120 chain && { timeout 150 python3 benchmarks/tile_prefetch_chain.py --json $W/chain.json > $W/chain.txt 2>&1
  log chain $?; cat $W/chain.txt | tee -a $OUT/log.txt; }
fits 60 chain16 && { timeout 90 python3 benchmarks/tile_prefetch_chain.py --layers 16 --stages 12 --json $W/chain16.json \
  > $W/chain16.txt 2>&1; log chain16 $?; tail -4 $W/chain16.txt | tee -a $OUT/log.txt; }
