#!/usr/bin/env bash
# session 20, device call 2, on branch wip/dense-early (its engine defaults are main's), no carry.
# Call 1's 50 % lru profile with a cuMemcpyHtoDAsync an entry row (`--copy-batch-group 0`) showed the copy engine's
# first byte 11.7 us after the router (p90 13.0) against 13.8 (p90 17.0) with main's cuMemcpyBatchAsync of 2
# entries (session 19), at 3.2 us idle between an entry's two copies, and 74.3 tok/s (0.89). Session 11 measured
# G 0 slower, before an entry's row became one copy. The A/B, alternating twice, all four cells:
# main (G 2) / G 0, then G 1 (one entry a batch call) once if it fits.
# Predicted: ~2 us less a list at 38-46 lists a step: +0.5-0.7 % at 50 %, +0.3 % at 25 %.
# Run as: LIMIT=440 bash benchmarks/h200_session20/call2.sh
CALL=call2 LIMIT=${LIMIT:-440}
. "$(dirname "$0")/../h200_session19/common.sh"
run off_main_1 75 "$OFF"
run off_g0_1 75 "$OFF" --copy-batch-group 0
run off_main_2 75 "$OFF"
run off_g0_2 75 "$OFF" --copy-batch-group 0
run off_g1 75 "$OFF" --copy-batch-group 1
