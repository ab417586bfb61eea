#!/usr/bin/env bash
# device call 3 (final): all of tests/gpu on HEAD, the figures (resident, offloaded), and offloaded lru runs with the
# replaying thread pinned to one core (is the run-to-run spread the serving thread's placement?)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
trap 'cp $OUT/log.txt $W/ 2>/dev/null; tar czf $OUT/call.tgz -C $W .' EXIT
log() { echo "$1 rc $2 $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader | tee -a $OUT/log.txt
nproc | tee -a $OUT/log.txt
python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 tests/gpu > $W/gpu_tests.txt 2>&1
log tests $?; tail -3 $W/gpu_tests.txt | tee -a $OUT/log.txt
RES="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode graph --steps 32 --warmup 8 --prefill 0"
OFF="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru,scored --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
cs() { python3 -c "import json,sys; [print(' ', r['policy'], r['slots'], json.dumps(r.get('copy_service'))) for r in json.load(open(sys.argv[1]))['runs']]" $1 | tee -a $OUT/log.txt; }
python3 -m edgemoe bench $RES --json $W/resident.json > $W/resident.txt 2>&1; log resident $?; grep achieved $W/resident.txt | tee -a $OUT/log.txt
python3 -m edgemoe bench $OFF --json $W/offload.json > $W/offload.txt 2>&1; log offload $?; grep achieved $W/offload.txt | tee -a $OUT/log.txt; cs $W/offload.json
OFFL="--geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5 --moe-policy lru --routing-trace synthetic --mode graph --steps 16 --warmup 8 --prefill 0"
for core in 3 11; do
  python3 benchmarks/decode_variants.py --pin-core $core -- $OFFL --json $W/pinned$core.json > $W/pinned$core.txt 2>&1
  log "pinned $core" $?; grep achieved $W/pinned$core.txt | tee -a $OUT/log.txt; cs $W/pinned$core.json
done
