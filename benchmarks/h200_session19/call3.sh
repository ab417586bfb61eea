#!/usr/bin/env bash
# written in session 19, ran as its device call 3 (outputs: call3_*) on branch wip/copy-head (458b005: main + the
# SMs copying the first N KiB of each copy list's first entry while the host and the copy engine start, the copy
# service the rest: copy_service.HEAD_BYTES, 0 by default there; decode_variants.py --copy-head-kib N), no carry.
# 0. The GPU tests the branch touches (copy-service graph tests with and without a head, the streamed experts after
#    a posting ensure with a 256 KiB head, the engine through the service with a 16 KiB head); stops if they fail.
# 1. The copy-list profile at 50 % lru with a 256 KiB head (call 1, none: first byte 13.8 us after the router,
#    ensure ends at 6.0; link idle 3168 us a step).
# 2. Offloaded decode: heads of 256 KiB, none, 512 KiB, none.
# Predicted: the SMs read the head from ~7 us after the router, when the link is idle until the copy engine's
# first byte at ~14 us; the copy engine then has 256 KiB (4.8 us at 54 GB/s) less to copy, the SMs' reads delaying
# its start by ~1-2 us: ~3-5 us less a list, +1-1.4 % at 50 % lru (72 -> 73 tok/s), +0.5-1 % at 25 %. 512 KiB: more
# only if the SMs' reads do not hold up the copy engine's start. Run as:
#   LIMIT=480 bash benchmarks/h200_session19/call3.sh
# As it ran, step 0 failed: tests/kernels/test_miss_copy.py is an interpreter-only file (CPU tensors; on a CUDA
# machine all its launches fail, its old tests as well as the new one), so the script stopped after the tests.
# The GPU tests themselves all passed (58). Steps 1-2 then ran as call 4 (call4.sh), on the same machine.
CALL=call3 LIMIT=${LIMIT:-480}
. "$(dirname "$0")/common.sh"
gpu_tests 200 tests/gpu/test_copy_service_gpu.py \
  tests/kernels/test_miss_copy.py tests/gpu/test_expert_offload.py
run prof_head256 65 "$P" --copy-head-kib 256
run off_head256 75 "$OFF" --copy-head-kib 256
run off_none_1 75 "$OFF"
run off_head512 75 "$OFF" --copy-head-kib 512
run off_none_2 75 "$OFF"
