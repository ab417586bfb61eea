#!/usr/bin/env bash
# session 20, device call 3, on branch wip/dense-early, no carry: the persistent-chain probe's static variant.
# Session 15's probe (an atomic task queue) lost to PDL boundaries: 7.6-8.0 us a GEMV against the engine's 6.6.
# It named two untried designs; this is one: a static assignment, program p runs row block p of each GEMV (4 rows
# for 2048-row GEMVs, 8 for 4096-row ones: the engine's configs; 512 programs, all resident), so no queue grab, and
# its next weights are known before its wait. Predicted: 6.0-6.5 us a GEMV without preloads (the hand-off costs
# about a PDL boundary), 5.5-6.0 with 512 columns preloaded; a design for resident decode needs <= ~5.
# Run as: LIMIT=200 bash benchmarks/h200_session20/call3.sh
CALL=call3 LIMIT=${LIMIT:-200}
. "$(dirname "$0")/../h200_session19/common.sh"
timeout 120 python3 benchmarks/persistent_chain.py --check > $W/chain_check.txt 2>&1; log chain_check $?
cat $W/chain_check.txt | tail -5 | tee -a $OUT/log.txt
timeout 150 python3 benchmarks/persistent_chain.py --prefetch-k 0,512,1024 --programs-per-sm 4 --reps 100 \
  --json $W/chain.json > $W/chain.txt 2>&1; log chain $?
cat $W/chain.txt | tail -12 | tee -a $OUT/log.txt
