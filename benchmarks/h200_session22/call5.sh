#!/usr/bin/env bash
# session 22, call 5: the attention reduce kernel asks L2 for the o projection's weight (16.8 MB at qwen3), after or
# before its PDL wait (`--reduce-l2-next`), so that o's bytes start moving while attention finishes; HBM is nearly idle
# during the reduce (it reads partials from L2). Predicted (after): o adds ~1-1.5 us a layer less, +2-3 % resident;
# before: less, as partial is then slowed (session 14's o prefetch from partial lost 2.2 us a layer).
# Run as: LIMIT=330 bash benchmarks/h200_session22/call5.sh
CALL=call5 LIMIT=${LIMIT:-330}
. "$(dirname "$0")/../h200_session19/common.sh"
gpu_tests 150 tests/gpu/test_paged_attention_gpu.py
for i in 1 2; do
  run res_new_$i 25 "$RES"
  run res_after_$i 25 "$RES" --reduce-l2-next after
  run res_before_$i 25 "$RES" --reduce-l2-next before
done
run res_prof_after 40 "$RES --profile 4" --reduce-l2-next after
