#!/usr/bin/env bash
# session 20, device call 5, on branch wip/dense-early, no carry. Call 4 found the probe's engine chain slow only
# where two builds of the GEMV alternate (8.6-9.0 us a GEMV against 6.3-6.6 for one build), and faster without
# PDL (7.1). Suspect: each kernel's own L1 / shared split, so an SM drains before the next kernel can start on it.
# 1. The chain with one carveout for every kernel (benchmarks/smem_carveout.py): none, 100 %, 50 %.
#    Predicted, if the split is the cause: the engine's mixed steps ~6.3-6.6 at 100 and 50.
# 2. Resident decode with --smem-carveout 100 against main, alternating twice. Decode alternates ~10 builds a
#    layer (qkv and o are two GEMV builds, partial 39 KB a program, ...). Predicted, if so: a few % (the small
#    kernels' and GEMVs' fixed costs); else a tie. 3. Offloaded with it, if time is left.
# Run as: LIMIT=330 bash benchmarks/h200_session20/call5.sh
CALL=call5 LIMIT=${LIMIT:-330}
. "$(dirname "$0")/../h200_session19/common.sh"
for c in "" 100 50; do
  EDGEMOE_SMEM_CARVEOUT=$c timeout 90 python3 benchmarks/h200_session20/call4_engine_chain.py > $W/chain_c${c:-none}.txt 2>&1
  log chain_c${c:-none} $?; grep -E "carveout|rows engine|no PDL|static" $W/chain_c${c:-none}.txt | tee -a $OUT/log.txt
done
run res_main_1 25 "$RES"
run res_c100_1 25 "$RES" --smem-carveout 100
run res_main_2 25 "$RES"
run res_c100_2 25 "$RES" --smem-carveout 100
run off_c100 75 "$OFF" --smem-carveout 100
