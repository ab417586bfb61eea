#!/usr/bin/env bash
# As run: branch wip/session21, i.e. main + deferred_norm.patch (this folder; `git apply` on main after session 21).
# session 21, device call 3 (branch wip/session21: main's engine + the additive `norm_gemv(deferred=True)` mode and
# its tests; no engine path of main changed).
# 0. All of tests/gpu (last full run: session 18, on 135e6a2).
# 1. Resident A/B, alternating twice: main / norm-first inside qkv after a one-program spacer (`--norm-gemv
#    on-spacer`). Call 2: the spacer costs ~0.06 us a layer and recovers qkv's placement after down; norm-first's
#    qkv grew ~1.2 us without PDL (session 8) against the norm kernel's 1.5. Predicted: +0.3-0.6 %.
# 2. Issue #5's figures on main's engine: offloaded 25 / 50 % lru / scored (OFF), resident graphs with the upload
#    policies' profiles (gaps), resident eager.
# Run as: LIMIT=560 bash benchmarks/h200_session21/call3.sh
CALL=call3 LIMIT=${LIMIT:-560}
. "$(dirname "$0")/../h200_session19/common.sh"
timeout 330 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 tests/gpu > $W/gpu_tests.txt 2>&1
log tests $?; tail -3 $W/gpu_tests.txt | tee -a $OUT/log.txt; grep -E "^FAILED|^ERROR" $W/gpu_tests.txt | head | tee -a $OUT/log.txt
for i in 1 2; do
  run res_base_$i 25 "$RES"
  run res_onsp_$i 25 "$RES" --norm-gemv on-spacer
done
run off_main 75 "$OFF"
run res_prof_main 50 "$RES --profile 4"
RES_EAGER="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode eager --steps 8 --warmup 2 --prefill 0"
run res_eager 45 "$RES_EAGER"
