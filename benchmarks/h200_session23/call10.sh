#!/usr/bin/env bash
# session 23, call 10: session 22's eager drift (31.7 -> 22.1 -> 22.3 -> 15.1 tok/s, each run slower whatever its
# settings). Is it the host? Each eager run (main, unchanged) follows two host probes in fresh processes: a pure-Python
# loop and 20,000 tiny CUDA launches. Then one eager run under cProfile (where host time goes). Predicted: if the
# probes slow with the runs, the host (a shared machine) drifts, not edgemoe.
# Run as: LIMIT=300 bash benchmarks/h200_session23/call10.sh
CALL=call10 LIMIT=${LIMIT:-300}
. "$(dirname "$0")/../h200_session19/common.sh"
RES_EAGER="--geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --mode eager --steps 8 --warmup 2 --prefill 0"
probe() {
  python3 -c "import time; t=time.perf_counter(); s=0
for i in range(10_000_000): s += i
print(f'python loop {time.perf_counter()-t:.3f} s')" | tee -a $OUT/log.txt
  python3 -c "import time, torch; x=torch.zeros(1, device='cuda'); [x.add_(1) for _ in range(2000)]; torch.cuda.synchronize()
t=time.perf_counter(); [x.add_(1) for _ in range(20000)]; torch.cuda.synchronize()
print(f'tiny CUDA launch {(time.perf_counter()-t)/20000*1e6:.2f} us')" | tee -a $OUT/log.txt
}
for i in 1 2 3; do probe; run eager_$i 45 "$RES_EAGER"; grep "eager:" $W/eager_$i.txt | tee -a $OUT/log.txt; done
probe
fits 60 prof && { timeout 90 python3 -m cProfile -o $W/eager.prof benchmarks/decode_variants.py -- $RES_EAGER \
  > $W/eager_prof.txt 2>&1; log prof $?; grep "eager:" $W/eager_prof.txt | tee -a $OUT/log.txt
  python3 -c "import pstats; pstats.Stats('$W/eager.prof').sort_stats('tottime').print_stats(25)" > $W/eager_pstats.txt
  head -60 $W/eager_pstats.txt | tail -40 | tee -a $OUT/log.txt; }
nproc; uptime | tee -a $OUT/log.txt
