#!/usr/bin/env bash
# As run: branch wip/session21, i.e. main + deferred_norm.patch (this folder; `git apply` on main after session 21) + session 20's
# next_route_in_up.patch (which applies to e7f6749).
# session 21, device call 1, on branch wip/session21: main + session 20's route-in-up patch (resident up routes its
# pairs itself; `--route-kernel` restores main's routing launch) + `norm_gemv(deferred=True)` (the pre-attention add
# + RMSNorm inside qkv with h's 1 / rms applied to the sums after the loop, so no pass over the row before the
# weights stream; `--norm-gemv deferred`).
# 0. The GPU tests these touch (a failure is logged, the A/B goes on with the variants that ran).
# 1. Resident A/B, alternating twice: main's engine / route in up / deferred norm / norm-first with one carveout
#    (session 20's carveout finding as the cause of norm-first's 7 % loss under PDL) / route in up + deferred norm;
#    once: route in up uncapped.
#    Predicted: up +1.5-2.5 %; deferred +2-2.5 % (add_rms_norm adds 1.5 us a layer; the loop's extra loads hit L2);
#    on+c100: a tie or small gain if the carveout was the cause; both: +3.5-5 %.
# 2. The profile of route in up + deferred; 3. offloaded with it.
# Run as: LIMIT=540 bash benchmarks/h200_session21/call1.sh
CALL=call1 LIMIT=${LIMIT:-540}
. "$(dirname "$0")/../h200_session19/common.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 tests/gpu/test_moe_gemv_gpu.py \
  tests/gpu/test_norm_route_gpu.py tests/gpu/test_router_gpu.py tests/gpu/test_norm_gemv_gpu.py > $W/gpu_tests.txt 2>&1
log tests $?; tail -2 $W/gpu_tests.txt | tee -a $OUT/log.txt; grep -E "^FAILED|^ERROR" $W/gpu_tests.txt | head -20 | tee -a $OUT/log.txt
for i in 1 2; do
  run res_base_$i 25 "$RES" --route-kernel
  run res_up_$i 25 "$RES"
  run res_def_$i 25 "$RES" --route-kernel --norm-gemv deferred
  run res_on_c100_$i 25 "$RES" --route-kernel --norm-gemv on --smem-carveout 100
  run res_up_def_$i 25 "$RES" --norm-gemv deferred
done
run res_up_nocap 25 "$RES" --route-registers 0
run res_prof_up_def 50 "$RES --profile 4" --norm-gemv deferred
run off_up_def 75 "$OFF" --norm-gemv deferred
