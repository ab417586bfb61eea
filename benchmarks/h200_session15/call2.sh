#!/usr/bin/env bash
# session 15, device call 2: the o GEMV with more bytes in flight, in decode (resident A/B, then offloaded)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call2.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
RES="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode graph --steps 32 --warmup 8 --prefill 0"
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
O512="--dense-config 2048x4096=n4_k512_w4_s4"
O6="--dense-config 2048x4096=n4_k256_w4_s6"
O1024="--dense-config 2048x4096=n4_k1024_w4_s3"
res() { name=$1; shift; python3 benchmarks/decode_variants.py "$@" -- $RES --json $W/res_$name.json > $W/res_$name.txt 2>&1
  rc=$?; log "$name $(grep -o 'graph: [0-9.]* tok/s' $W/res_$name.txt)" $rc; }
off() { name=$1; shift; python3 benchmarks/decode_variants.py "$@" -- $OFF --json $W/off_$name.json > $W/off_$name.txt 2>&1
  rc=$?; log "$name" $rc; grep "achieved/bound" $W/off_$name.txt | tee -a $OUT/log.txt; }
res eng_1
res o512_1 $O512
res o6_1 $O6
res o1024_1 $O1024
res eng_2
res o512_2 $O512
res o6_2 $O6
res o1024_2 $O1024
python3 benchmarks/decode_variants.py $O512 -- $RES --steps 16 --profile 4 --json $W/res_profile_o512.json > $W/res_profile_o512.txt 2>&1; log profile_o512 $?
python3 benchmarks/decode_variants.py -- $RES --steps 16 --profile 4 --json $W/res_profile_eng.json > $W/res_profile_eng.txt 2>&1; log profile_eng $?
off eng_1
off o512_1 $O512
