#!/usr/bin/env bash
# As run: branch wip/session21, i.e. main + deferred_norm.patch (this folder; `git apply` on main after session 21).
# session 21, device call 2 (branch wip/session21: main + `norm_gemv(deferred=True)`). Call 1: the deferred norm
# inside qkv lost 3.9 % (qkv +4.1 us a layer, the norm kernel's 1.5 gone), norm-first lost 7.7 % even with one
# carveout. Hypothesis: a kernel after the MoE down GEMV (2,048 programs) is placed on the SMs while down's last
# programs still run, packing qkv's 640 programs onto the SMs that free up first (up to the occupancy limit, which
# the probe below reads), so qkv runs on a skewed spread. Tests of it:
# 0. the deferred kernel's registers / shared memory / programs an SM by stages (occupancy.py);
# 1. resident A/B: main / deferred after a one-program spacer / deferred at 8 and 12 stages (fewer programs an SM if
#    shared memory binds) / main with a spacer before down (the same effect at up -> down?), twice.
#    Predicted if the hypothesis holds: spacer recovers qkv (+1.5-2 % over main: the norm kernel's 1.5 us less the
#    spacer's ~0.5); stages that cap an SM at 5 recover it without a spacer.
# 2. the profile of the best.
# Run as: LIMIT=420 bash benchmarks/h200_session21/call2.sh
CALL=call2 LIMIT=${LIMIT:-420}
. "$(dirname "$0")/../h200_session19/common.sh"
timeout 120 python3 benchmarks/h200_session21/occupancy.py > $W/occupancy.txt 2>&1; log occupancy $?
cat $W/occupancy.txt | tee -a $OUT/log.txt
for i in 1 2; do
  run res_base_$i 25 "$RES"
  run res_defsp_$i 25 "$RES" --norm-gemv deferred-spacer
  run res_def8_$i 25 "$RES" --norm-gemv deferred --deferred-stages 8
  run res_def12_$i 25 "$RES" --norm-gemv deferred --deferred-stages 12
  run res_downsp_$i 25 "$RES" --down-spacer
done
run res_prof_defsp 50 "$RES --profile 4" --norm-gemv deferred-spacer
