#!/usr/bin/env bash
# planned in session 20 for the next device session (NOT run yet). Resident experts route inside their up kernel:
# `benchmarks/h200_session20/next_route_in_up.patch` (on main after session 20; the branch it came from,
# wip/route-in-up, may not survive into the next checkout). Before the call:
#   git checkout -b wip/route-in-up && git apply benchmarks/h200_session20/next_route_in_up.patch && git commit -qam \
#     "resident experts route inside the up kernel (session 20's patch)"
# What it changes: in resident decode the gate GEMV (with the post-attention norm) is followed directly by up, whose
# programs each route their pair's token from the logits (the routing kernel's code, `router._route_row`, computed in
# one copy of the row a warp so that its reductions stay in shuffles: offline sm_90, 10 barriers instead of 54), and
# one program a token stores the ids and weights for down. One launch fewer a MoE layer; the same bits (interpreter
# and GPU tests against route_logits + fused_experts, and the demo model's tokens). Offloaded experts, and experts
# with hooks (the routing recorder, the benchmark's traces), keep the routing kernel.
# Resident profile (session 20): `_route` adds 2.0 us a layer. The routing in up adds ~0.5-0.8 us to each up program
# before its weight loads (~780 instructions, 6 barriers), and its registers (60, 4 programs an SM against 5) are
# capped at 48 (`moe_gemv.ROUTE_REGISTERS`, a 16-byte stack). Predicted: +1.5-2.5 % resident (387 -> 393-397 tok/s);
# without the cap, less (up's ~1.45 waves against ~1.16). Offloaded: unchanged (it keeps the routing kernel).
# 0. GPU tests the change touches (stops on failure).
# 1. Resident A/B, alternating twice: the routing kernel (main's way, --route-kernel) / routing in up, cap 48 /
#    routing in up, no cap (--route-registers 0).
# 2. The resident profile with the routing in up (what up adds now).
# Then, if it wins: drop --route-kernel (and ROUTE_REGISTERS if the cap loses), and run all of tests/gpu in a call
# of its own. Run as: LIMIT=420 bash benchmarks/h200_session20/planned_next.sh
CALL=next LIMIT=${LIMIT:-420}
. "$(dirname "$0")/../h200_session19/common.sh"
gpu_tests 200 tests/gpu/test_moe_gemv_gpu.py tests/gpu/test_norm_route_gpu.py tests/gpu/test_router_gpu.py \
  tests/gpu/test_cuda_graphs.py
run res_kernel_1 25 "$RES" --route-kernel
run res_up48_1 25 "$RES"
run res_up_1 25 "$RES" --route-registers 0
run res_kernel_2 25 "$RES" --route-kernel
run res_up48_2 25 "$RES"
run res_up_2 25 "$RES" --route-registers 0
run res_prof_up48 50 "$RES --profile 4"
