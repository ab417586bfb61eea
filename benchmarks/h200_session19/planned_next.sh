#!/usr/bin/env bash
# planned in session 19 for the next device session (NOT run yet), on branch wip/dense-early (main + a switch,
# `dense_gemv.EARLY_WEIGHTS`, off by default, so that runs without the flag are main's kernels), no carry.
# Session 19 found the per-list costs of the offloaded copy near what host-driven copies allow (RESULTS.md, session
# 19): the lever left for both of issue #5's goals is resident work slower than its bytes. This call measures it
# afresh (session 8's per-kernel table is the last one without PDL, on older kernels) and tries one such change:
# 0. The dense-GEMV GPU tests (the early weights bitwise at the real shapes); stops if they fail.
# 1. Resident decode profiled without PDL: each kernel's own time (under PDL a kernel's time includes its wait).
# 2. The same with PDL: what each kernel adds to the step.
# 3. Resident decode with `--dense-early-weights` (each dense-GEMV program loads its first step of weights, ~4 KB,
#    before its PDL wait; offline sm_90: 2 loads move before ACQBULK, registers 40 and shared memory unchanged)
#    against main, alternating, twice. Predicted: the first load's round trip leaves the GEMV's ramp, ~0.5-0.7 us
#    of qkv's and o's ~6.9 each, 96 a step: 387.5 -> ~395 tok/s (+2 %). Session 12's prefetch of whole rows to L2
#    before the wait lost (366 against 382): its 17-21 MB a launch slowed the latency-bound kernel before; this
#    moves ~2.5 MB.
# 4. The copy-list profile at 25 % lru (session 19 profiled 50 % only).
# 5. The 50 % lru profile with a `cuMemcpyHtoDAsync` an entry instead of `cuMemcpyBatchAsync` (`--copy-batch-group
#    0`): does the copy engine's first byte, 13.8 us after the router and ~8 us after `ensure`'s end, come sooner?
#    (Session 11 measured G 0 slower in decode before an entry became one copy; no profile then.)
# 6. Offloaded decode with the early weights (main's: session 19's calls 1-4).
# Then, on what merges, all of tests/gpu (the README's GPU command, ~300 s) in a call of its own. Run as:
#   LIMIT=560 bash benchmarks/h200_session19/planned_next.sh
CALL=next LIMIT=${LIMIT:-560}
. "$(dirname "$0")/common.sh"
gpu_tests 120 tests/gpu/test_dense_gemv_gpu.py \
  tests/gpu/test_norm_gemv_gpu.py
P25="${P/--moe-cache-fraction 0.5/--moe-cache-fraction 0.25}"
run res_no_pdl_prof 60 "$RES --profile 4" --no-pdl
run res_prof 50 "$RES --profile 4"
run res_early_1 25 "$RES" --dense-early-weights
run res_main_1 25 "$RES"
run res_early_2 25 "$RES" --dense-early-weights
run res_main_2 25 "$RES"
run prof_25 65 "$P25"
run prof_g0 65 "$P" --copy-batch-group 0
run off_early 75 "$OFF" --dense-early-weights
