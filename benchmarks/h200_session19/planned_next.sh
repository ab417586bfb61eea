#!/usr/bin/env bash
# planned in session 19 for the next device session (NOT run yet), on main itself, no carry. Session 19 found the
# per-list costs of the offloaded copy near what host-driven copies allow (RESULTS.md, session 19): the lever left
# for both of issue #5's goals is resident work that runs slower than its bytes. This call measures it afresh
# (session 8's per-kernel table is the last one without PDL, on older kernels) and keeps a full GPU test run:
# 1. Resident decode profiled without PDL: each kernel's own time (under PDL a kernel's time includes its wait).
# 2. The same with PDL: what each kernel adds to the step.
# 3. The copy-list profile at 25 % lru (session 19 profiled 50 % only).
# 4. The 50 % lru profile with a `cuMemcpyHtoDAsync` an entry instead of `cuMemcpyBatchAsync` (`--copy-batch-group
#    0`): does the copy engine's first byte, 13.8 us after the router and ~8 us after `ensure`'s end, come sooner?
#    (Session 11 measured G 0 slower in decode before an entry became one copy; no profile then.)
# 5. All of tests/gpu on main, if the time is left (last full run: 135e6a2, 435 passed; main's kernels are unchanged since).
# Run as:
#   LIMIT=590 bash benchmarks/h200_session19/planned_next.sh
CALL=next LIMIT=${LIMIT:-590}
. "$(dirname "$0")/common.sh"
P25="${P/--moe-cache-fraction 0.5/--moe-cache-fraction 0.25}"
run res_no_pdl_prof 60 "$RES --profile 4" --no-pdl
run res_prof 50 "$RES --profile 4"
run prof_25 65 "$P25"
run prof_g0 65 "$P" --copy-batch-group 0
fits 330 gpu_tests || exit 0
timeout 330 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 tests/gpu > $W/gpu_tests.txt 2>&1
rc=$?; log gpu_tests $rc; tail -2 $W/gpu_tests.txt | tee -a $OUT/log.txt
