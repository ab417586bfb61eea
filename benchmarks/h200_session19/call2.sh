#!/usr/bin/env bash
# written in session 19, ran as its device call 2 (outputs: call2_*) on branch wip/staged-copy (31035b8: main +
# the copy service copying a list's gate_up rows before its down rows, each entry marked at both:
# copy_service.STAGED, on by default there; decode_variants.py --no-staged-copy gives the one-stage copy, main's),
# no carry.
# 0. The GPU tests the branch touches (the copy-service graph test staged and not; the streamed experts; the
#    engine's offload); stops if they fail.
# 1. The copy-list profile at 50 % lru, staged (call 1's, one stage: 16.7 us from the last byte to down's end,
#    8.7 to up's; link 54.3 GB/s while copying, idle 3168 us a step).
# 2. Offloaded decode, staged and one stage, alternating, twice.
# Predicted: up's 8.7 us leave the tail (it runs while the down rows cross) and down's hits' pairs run before the
# last byte, so the tail drops to ~5 us a list (~12 us x 38 lists = 0.45 ms a step less: 50 % lru 0.88 -> 0.91),
# less what the extra copy call and counter writes a list cost the link (session 12's probe of this order: 0.900 of
# a memcpy at one row a layer against 0.926). Run as:
#   LIMIT=560 bash benchmarks/h200_session19/call2.sh
CALL=call2 LIMIT=${LIMIT:-560}
. "$(dirname "$0")/common.sh"
gpu_tests 200 tests/gpu/test_copy_service_gpu.py \
  tests/gpu/test_streamed_experts_gpu.py tests/gpu/test_moe_gemv_gpu.py tests/kernels/test_moe_gemv.py \
  tests/gpu/test_expert_offload.py
run prof_staged 65 "$P"
run off_staged_1 75 "$OFF"
run off_one_1 75 "$OFF" --no-staged-copy
run off_staged_2 75 "$OFF"
run off_one_2 75 "$OFF" --no-staged-copy
