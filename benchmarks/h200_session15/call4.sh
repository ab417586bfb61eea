#!/usr/bin/env bash
# session 15, device call 4: all of tests/gpu on the final tree (f51c093 + docs)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 400 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 tests/gpu > $OUT/gpu_tests.txt 2>&1
echo "tests rc $? $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
tail -3 $OUT/gpu_tests.txt
