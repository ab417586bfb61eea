#!/usr/bin/env bash
# session 23, call 11: which kernels miss Triton's in-memory JIT cache in eager decode (call 10: the final rms_norm
# compiles at every step, ~37 ms a step of a ~60 ms eager step). Predicted: _rms_norm misses at every step with a
# specialization that changes (an argument's alignment or a value specialised as 1 / divisible by 16).
# Run as: LIMIT=150 bash benchmarks/h200_session23/call11.sh
CALL=call11 LIMIT=${LIMIT:-150}
. "$(dirname "$0")/../h200_session19/common.sh"
RES_EAGER="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode eager --steps 8 --warmup 2 --prefill 0"
fits 80 misses && { timeout 110 python3 benchmarks/h200_session23/jit_misses.py -- $RES_EAGER > $W/misses.txt 2>&1
  log misses $?; grep -E "JIT miss.*_rms_norm|JIT misses by|eager:" $W/misses.txt | head -30 | tee -a $OUT/log.txt; }
