#!/usr/bin/env bash
# The H200 figures of issues #4-#6 (benchmarks/RESULTS.md), one part per device call (each fits in 10 minutes):
#   bash benchmarks/figures.sh OUT_DIR qwen3     # qwen3-30b-a3b, 48 layers, 4K: 25/50/100 % cached, lru/scored,
#                                                #   eager and graph, graph-upload profiles
#   bash benchmarks/figures.sh OUT_DIR qwen15    # qwen1.5-moe-a2.7b, 32K context, a 16 GiB card: lru/scored x
#                                                #   shared-expert overlap off/on, profiles (overlap fraction)
#   bash benchmarks/figures.sh OUT_DIR qwen15-cached  # the same with every expert cached (no miss copy): does
#                                                #   the side stream help resident-like decode?
#   bash benchmarks/figures.sh OUT_DIR qwen3-resident  # qwen3-30b-a3b with every expert resident on the device:
#                                                #   eager and graph against the HBM roofline (issue #5)
#   bash benchmarks/figures.sh OUT_DIR candidates  # what is not yet in the engine against what it runs: dense
#                                                #   projections, miss-copy loads (CUDA C++), copy-engine copies
#                                                #   chosen on the device (switch nodes in a graph)
#   bash benchmarks/figures.sh OUT_DIR boundary  # is the kernel boundary what decode loses? 8 dependent GEMVs as
#                                                #   engine launches against one persistent launch; the dense
#                                                #   GEMV with more bytes in flight (issue #5; ~1 minute)
# Run from the repo root on the GPU machine (torch with CUDA; nothing to install).
set -euo pipefail
out=${1:?OUT_DIR}
part=${2:?qwen3, qwen3-resident, qwen15, qwen15-cached, candidates or boundary}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
case "$part" in
  qwen3)
    python3 -m edgemoe bench --geometry qwen3-30b-a3b --context 4096 --moe-cache-fraction 0.25,0.5,1 \
      --moe-policy lru,scored --routing-trace synthetic --steps 16 --warmup 8 --prefill 512 --profile 4 \
      --json "$out/bench_qwen3.json" --plot "$out/bench_qwen3.png" > /dev/null ;;
  qwen15)
    python3 -m edgemoe bench --geometry qwen1.5-moe-a2.7b --context 32768 --vram-budget 16GiB \
      --moe-policy lru,scored --shared-expert-overlap off,on --routing-trace synthetic --mode graph \
      --steps 16 --warmup 8 --prefill 0 --profile 6 --json "$out/bench_qwen15_32k.json" > /dev/null ;;
  qwen15-cached)
    python3 -m edgemoe bench --geometry qwen1.5-moe-a2.7b --context 32768 --moe-cache-fraction 1 \
      --moe-policy lru --shared-expert-overlap off,on,off,on --routing-trace synthetic --mode graph \
      --steps 32 --warmup 8 --prefill 0 --profile 4 --json "$out/bench_qwen15_cached.json" > /dev/null ;;
  qwen3-resident)
    python3 -m edgemoe bench --geometry qwen3-30b-a3b --context 4096 --moe-strategy resident --steps 16 --warmup 8 \
      --prefill 512 --profile 4 --json "$out/bench_qwen3_resident.json" > /dev/null ;;
  candidates)
    python3 benchmarks/dense_gemv.py --json "$out/dense_gemv.json"
    python3 benchmarks/miss_copy_cuda.py --json "$out/miss_copy_cuda.json"
    python3 benchmarks/miss_copy_graph.py --json "$out/miss_copy_graph.json" ;;
  boundary)
    python3 benchmarks/persistent_chain.py --json "$out/persistent_chain.json"
    python3 benchmarks/dense_gemv.py --tokens 1 --shapes qwen3 --json "$out/dense_gemv_in_flight.json" \
      --configs n4_k256_w4_s4,n8_k256_w4_s4,n4_k512_w4_s4,n4_k1024_w4_s3,n8_k512_w4_s4,n4_k256_w4_s6 ;;
  *) echo "unknown part $part: qwen3, qwen3-resident, qwen15, qwen15-cached, candidates or boundary" >&2; exit 2 ;;
esac
