#!/usr/bin/env bash
# session 15, device call 3: pick_block_k (512-column steps for rows >= 4096) alone and in decode; bounds settled
# after the runs; the GPU tests of the touched kernels
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call3.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
RES="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode graph --steps 32 --warmup 8 --prefill 0"
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
OLD="--dense-config 2048x4096=n4_k256_w4_s4"
res() { name=$1; shift; python3 benchmarks/decode_variants.py "$@" -- $RES --json $W/res_$name.json > $W/res_$name.txt 2>&1
  rc=$?; log "$name $(grep -o 'graph: [0-9.]* tok/s' $W/res_$name.txt | tail -1) $(grep -o 'bandwidths after.*' $W/res_$name.txt)" $rc; }
off() { name=$1; shift; python3 benchmarks/decode_variants.py "$@" -- $OFF --json $W/off_$name.json > $W/off_$name.txt 2>&1
  rc=$?; log "$name" $rc; grep -E "achieved/bound|bandwidths after" $W/off_$name.txt | tee -a $OUT/log.txt; }
timeout 120 python3 benchmarks/dense_gemv.py --tokens 1 --json $W/dense_gemv.json \
  --configs n4_k256_w4_s4,n4_k512_w4_s4,n8_k256_w4_s4,n8_k512_w4_s4 > $W/dense_gemv.txt 2>&1; log dense_gemv $?
grep -v -i warn $W/dense_gemv.txt | tee -a $OUT/log.txt
res new_1
res old_1 $OLD
res new_2
res old_2 $OLD
off new_1
off old_1 $OLD
timeout 200 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 tests/gpu/test_dense_gemv_gpu.py \
  tests/gpu/test_norm_gemv_gpu.py tests/gpu/test_cuda_engine.py tests/gpu/test_cuda_graphs.py > $W/gpu_tests.txt 2>&1
log tests $?; tail -2 $W/gpu_tests.txt | tee -a $OUT/log.txt
