#!/usr/bin/env bash
# session 15, device call 1: is the kernel boundary what decode loses? (persistent_chain) + dense GEMV in flight
set -u
export PYTHONPATH=$PWD
d=$OUT/call1; mkdir -p $d
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $d/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $d/gpu.txt 2>&1
( time timeout 150 python3 benchmarks/persistent_chain.py --check ) > $d/check.txt 2>&1; echo "check rc=$?" >> $d/check.txt
tail -3 $d/check.txt
timeout 200 python3 benchmarks/persistent_chain.py --json $d/chain_n4.json > $d/chain_n4.txt 2>&1; echo "rc=$?" >> $d/chain_n4.txt
cat $d/chain_n4.txt | grep -v -i warn
timeout 150 python3 benchmarks/persistent_chain.py --block-n 8 --prefetch-k 0,1024 --json $d/chain_n8.json > $d/chain_n8.txt 2>&1; echo "rc=$?" >> $d/chain_n8.txt
cat $d/chain_n8.txt | grep -v -i warn
timeout 200 python3 benchmarks/dense_gemv.py --tokens 1 --shapes qwen3 --json $d/dense_in_flight.json \
  --configs n4_k256_w4_s4,n8_k256_w4_s4,n4_k512_w4_s4,n4_k1024_w4_s3,n8_k512_w4_s4,n4_k256_w4_s6 > $d/dense.txt 2>&1; echo "rc=$?" >> $d/dense.txt
cat $d/dense.txt | grep -v -i warn
python3 - <<'PY' >> $d/dense.txt
import json; r = json.load(open("$OUT/call1/dense_in_flight.json".replace("$OUT", __import__("os").environ["OUT"])))
for k, v in r.items():
    if isinstance(v, dict):
        print(k, {c: round(t, 2) for c, t in v["candidate_us"].items()})
PY
tail -2 $d/dense.txt
cd $OUT && tar czf call1.tgz call1 && rm -rf call1
