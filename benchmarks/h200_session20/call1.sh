#!/usr/bin/env bash
# session 20, device call 1, on branch wip/dense-early (main + `dense_gemv.EARLY_WEIGHTS`, off by default, so runs
# without the flag are main's kernels), no carry. Session 19 prepared this change, but its branch did not survive
# into this session's checkout; it was written again here from that session's note (the same design: each
# dense-GEMV program loads its first step of weights, ~4 KB, before its PDL wait; offline sm_90: 2 loads before
# ACQBULK, 40 registers, shared memory unchanged).
# 0. The dense-GEMV GPU tests (the early weights bitwise at the real shapes, the demo model's tokens); stops on failure.
# 1. Resident decode profiled (PDL): what each kernel adds to the step, main.
# 2. Resident A/B, alternating twice: main / early weights / early weights with the pre-attention norm inside qkv
#    (`--norm-gemv on`: under PDL that fusion lost before, session 8, by one L2 round trip after the wait; with the
#    weights' round trip moved before the wait it may now win the norm kernel's ~1.5 us a layer).
#    Predicted: early +2 % (387.5 -> ~395 tok/s); early + norm-gemv +3-4 % (~402).
# 3. The early weights profiled (which kernels moved).
# 4. Offloaded decode with the early weights; 5. the 50 % lru profile with a cuMemcpyHtoDAsync an entry (G 0).
# Run as: LIMIT=560 bash benchmarks/h200_session20/call1.sh
CALL=call1 LIMIT=${LIMIT:-560}
. "$(dirname "$0")/../h200_session19/common.sh"
gpu_tests 150 tests/gpu/test_dense_gemv_gpu.py tests/gpu/test_norm_gemv_gpu.py
run res_prof 50 "$RES --profile 4"
run res_main_1 25 "$RES"
run res_early_1 25 "$RES" --dense-early-weights
run res_early_norm_1 25 "$RES" --dense-early-weights --norm-gemv on
run res_main_2 25 "$RES"
run res_early_2 25 "$RES" --dense-early-weights
run res_early_norm_2 25 "$RES" --dense-early-weights --norm-gemv on
run res_prof_early 50 "$RES --profile 4" --dense-early-weights
run off_early 75 "$OFF" --dense-early-weights
run prof_g0 65 "$P" --copy-batch-group 0
