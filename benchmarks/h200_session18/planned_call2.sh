#!/usr/bin/env bash
# planned for the next device session (written in session 18, NOT run yet): after planned_call1.sh, on the same
# branch (wip/late-trigger), no carry. The second round of offloaded A/B runs (the engine, the 8-row up, down after
# the listed programs, down after every up program), so that each variant has two runs beside the engine's. If a
# variant wins, all of tests/gpu on the tree that would merge comes next. Run as:
#   LIMIT=400 bash benchmarks/h200_session18/planned_call2.sh
CALL=call2 LIMIT=${LIMIT:-400}
. "$(dirname "$0")/planned_common.sh"
run off_main_2 75 "$OFF"
run off_up8_2 75 "$OFF" $UP8
run off_late_2 75 "$OFF" --up-trigger listed-end
run off_end_1 75 "$OFF" --up-trigger end
