#!/usr/bin/env bash
# device call 2: the copy service with LEAD 0/1 (GPU tests, then offloaded decode A/B twice, alternating)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader | tee -a $OUT/log.txt
python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 tests/gpu/test_copy_service_gpu.py > $W/gpu_tests.txt 2>&1
log tests $?; tail -2 $W/gpu_tests.txt | tee -a $OUT/log.txt
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
for run in lead0_1 lead1_1 lead0_2 lead1_2; do
  python3 benchmarks/decode_variants.py --copy-lead ${run:4:1} -- $OFF --json $W/off_$run.json > $W/off_$run.txt 2>&1
  log "off $run" $?; grep achieved $W/off_$run.txt | tee -a $OUT/log.txt
  python3 -c "import json,sys; [print(' ', r['policy'], r['slots'], json.dumps(r.get('copy_service'))) for r in json.load(open(sys.argv[1]))['runs']]" $W/off_$run.json | tee -a $OUT/log.txt
done
