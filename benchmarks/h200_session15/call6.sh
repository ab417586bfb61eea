#!/usr/bin/env bash
# session 15, device call 6: fewer pipeline stages (less shared memory a program) for the dense GEMVs in decode
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call6.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
RES="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode graph --steps 32 --warmup 8 --prefill 0"
res() { name=$1; shift; python3 benchmarks/decode_variants.py "$@" -- $RES --json $W/res_$name.json > $W/res_$name.txt 2>&1
  rc=$?; log "$name $(grep -o 'graph: [0-9.]* tok/s' $W/res_$name.txt | tail -1)" $rc; }
for r in 1 2; do
  res eng_$r
  res o_s3_$r --dense-config 2048x4096=n4_k512_w4_s3
  res o_s2_$r --dense-config 2048x4096=n4_k512_w4_s2
  res qkv_s3_$r --dense-config 5120x2048=n8_k256_w4_s3
done
