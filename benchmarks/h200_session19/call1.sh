#!/usr/bin/env bash
# written in session 18 (as planned_call1.sh), ran in session 19 as device call 1 on branch wip/late-trigger (81d507c:
# main 6c51c68 + where the streamed up after a posting ensure lets down be scheduled: moe_gemv.UP_TRIGGER,
# decode_variants.py --up-trigger start|end|listed-end; the engine's default, start, unchanged), no carry. Its
# outputs: call1_*. (Session 18's planned_call2.sh, a second round of the same A/B, was not run: nothing here won.)
# 0. The GPU tests the branch touches (the copy-service graph test over the three triggers); stops if they fail.
# 1. The copy-list profile at 50 % lru with the tail's new split (last byte -> up's end, -> down's end: 16.0 us to
#    down's end in session 18's call 1), for the engine and for down let in after the listed programs.
# 2. Resident decode for the engine and for up at 8 rows a program, 4 warps, 8 (and 6) stages (`--up-rows 8
#    --up-warps 4 --up-stages 8`: 768 programs, 8 an SM by shared memory, the same 32 KB in flight a program and the
#    same per-row layout as the engine's 16 rows x 8 warps x 4 stages in an offline sm_90 build, so the same bits;
#    the last listed expert's up then spreads over 96 programs of 65 KB instead of 48 of 131 KB).
# 3. Offloaded decode: the engine, the 8-row up, down after the listed programs.
# Predicted: 8-row up: up's share of the tail halves (~3 us less a list: +0.8 % at 50 %), resident up nearer its
# bytes (14.1 -> ~13 us a layer: +2 %). listed-end: if down's 2,048 programs waiting resident through the copy slow
# the last listed expert's up (session 18's split: 10.6 us from the last byte to up's end), ~3 us less a list
# (+0.8 %); if their wait is free, -0.6 % (down's launch after the last up). Run as:
#   LIMIT=560 bash benchmarks/h200_session19/call1.sh
CALL=call1 LIMIT=${LIMIT:-560}
. "$(dirname "$0")/common.sh"
gpu_tests 130 tests/gpu/test_copy_service_gpu.py \
  tests/gpu/test_streamed_experts_gpu.py tests/kernels/test_moe_gemv.py
run prof_main 65 "$P"
run prof_late 65 "$P" --up-trigger listed-end
run res_main 25 "$RES"
run res_up8 25 "$RES" $UP8
run res_up8s6 25 "$RES" --up-rows 8 --up-warps 4 --up-stages 6
run off_main_1 75 "$OFF"
run off_up8_1 75 "$OFF" $UP8
run off_late_1 75 "$OFF" --up-trigger listed-end
