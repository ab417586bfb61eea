#!/usr/bin/env bash
# ran in session 18 as device call 5 (the device time left after call 4: 227 s), on branch wip/split-listed, as one
# command line: call 4's A/B and profile without its tests (call 4 stopped on a new CPU-shaped kernel test that is
# not bitwise on the GPU; the copy-service graph test at qwen3's shapes, bitwise, passed there).
export PYTHONPATH=$PWD
O="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
for v in split:"" one:--no-split-listed; do n=${v%%:*}; f=${v#*:}
  timeout 90 python3 benchmarks/decode_variants.py $f -- $O --json $OUT/off_$n.json > $OUT/off_$n.txt 2>&1; echo $n rc $?
  grep achieved/bound $OUT/off_$n.txt | head -4; done
timeout 60 python3 benchmarks/decode_variants.py -- --geometry qwen3-30b-a3b --context 4096 --moe-policy lru \
  --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0 --profile 4 --moe-cache-fraction 0.5 \
  --json $OUT/prof_split.json > $OUT/prof_split.txt 2>&1; echo prof rc $?
grep -E "achieved|copy lists|_up|_down" $OUT/prof_split.txt | head -6
