#!/usr/bin/env bash
# As run: branch wip/session21, i.e. main + deferred_norm.patch (this folder; `git apply` on main after session 21).
# session 21, device call 4: call 3's on-spacer A/B again (its flag was missing from the argument's choices there).
# Resident, alternating three times: main / norm-first inside qkv after a one-program spacer. Predicted +0.3-0.6 %.
# Run as: LIMIT=170 bash benchmarks/h200_session21/call4.sh
CALL=call4 LIMIT=${LIMIT:-170}
. "$(dirname "$0")/../h200_session19/common.sh"
for i in 1 2 3; do
  run res_base_$i 22 "$RES"
  run res_onsp_$i 22 "$RES" --norm-gemv on-spacer
done
