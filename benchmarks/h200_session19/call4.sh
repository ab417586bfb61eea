#!/usr/bin/env bash
# session 19's device call 4 (outputs: call4_*), on branch wip/copy-head (458b005), the same machine as call 3 right
# after it: call3.sh's steps 1-2 without its step 0 (see call3.sh). It ran as this one command line:
CALL=call4 LIMIT=420; . benchmarks/h200_session19/common.sh
run prof_head256 65 "$P" --copy-head-kib 256
run off_head256 75 "$OFF" --copy-head-kib 256
run off_none_1 75 "$OFF"
run off_head512 75 "$OFF" --copy-head-kib 512
run off_none_2 75 "$OFF"
