#!/usr/bin/env bash
# device call 1: GPU tests for the touched kernels, then resident A/B of the attention prefetch / warps / stages,
# then offloaded figures with and without the prefetch (copy-service host timings in the JSON)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'tar czf $OUT/call.tgz -C $W . ; cp $OUT/log.txt $W/ 2>/dev/null' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader | tee -a $OUT/log.txt
python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 tests/gpu/test_paged_attention_gpu.py \
  tests/gpu/test_streamed_experts_gpu.py tests/gpu/test_copy_service_gpu.py > $W/gpu_tests.txt 2>&1
log tests $?; tail -3 $W/gpu_tests.txt | tee -a $OUT/log.txt
RES="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode graph --steps 32 --warmup 8 --prefill 0"
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
res() { name=$1; shift; python3 benchmarks/decode_variants.py "$@" -- $RES --json $W/res_$name.json > $W/res_$name.txt 2>&1
  rc=$?; log "$name $(grep -o 'graph: [0-9.]* tok/s' $W/res_$name.txt)" $rc; }
res pf0_1 --attention-prefetch-tiles 0
res pf2_1 --attention-prefetch-tiles 2
res pf1_1 --attention-prefetch-tiles 1
res pf4_1 --attention-prefetch-tiles 4
res w8s1_1 --attention-prefetch-tiles 0 --attention-warps 8 --attention-stages 1
res w8_1 --attention-prefetch-tiles 0 --attention-warps 8
res pf2w8_1 --attention-prefetch-tiles 2 --attention-warps 8
res pf0_2 --attention-prefetch-tiles 0
res pf2_2 --attention-prefetch-tiles 2
res w8s1_2 --attention-prefetch-tiles 0 --attention-warps 8 --attention-stages 1
for pf in 0 2; do
  python3 benchmarks/decode_variants.py --attention-prefetch-tiles $pf -- $RES --profile 4 --json $W/res_profile_pf$pf.json > $W/res_profile_pf$pf.txt 2>&1
  log "profile pf$pf" $?
done
for pf in 0 2; do
  python3 benchmarks/decode_variants.py --attention-prefetch-tiles $pf -- $OFF --json $W/off_pf$pf.json > $W/off_pf$pf.txt 2>&1
  log "off pf$pf" $?; grep achieved $W/off_pf$pf.txt | tee -a $OUT/log.txt
done
