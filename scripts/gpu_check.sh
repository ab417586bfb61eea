#!/usr/bin/env bash
# Everything the GPU machine must prove, in one call: the GPU tests, then the GPU benchmarks.
#   bash scripts/gpu_check.sh [OUT_DIR]      (repo root; torch with CUDA; nothing to install)
#   GPU_TESTS="tests/gpu/test_a.py ..." GPU_TESTS_ONLY=1 bash scripts/gpu_check.sh OUT   (some test files, no benchmarks)
#   GPU_WORKERS=4 bash scripts/gpu_check.sh OUT   (test files spread over 4 processes on the one GPU, with pytest-xdist:
#   carry its wheel and execnet's in .whl; the suite is mostly compile and host time, so this runs it ~3x faster; the
#   test files that time the CPU against the GPU (SERIAL) run alone afterwards)
# The tests' whole log goes to OUT/gpu_tests.log as it is written (unbuffered, one line a test), so a run cut short
# still says which tests passed and failed.
# The engine imports llguidance (constrained decoding), which the GPU machine lacks: carry its wheel (and gguf's) in
# .whl (`pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl
# llguidance gguf`; name .whl in the device call's carry); they are installed under /tmp/site here.
set -uo pipefail
out=${1:-${OUT:-/tmp/edgemoe-gpu}}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import llguidance" 2>/dev/null || { echo "gpu_check: llguidance is missing: carry its wheel in .whl (see above)"; exit 2; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
rc=0
tests=${GPU_TESTS:-tests/gpu}
SERIAL=tests/gpu/test_cpu_split_gpu.py
export PYTHONUNBUFFERED=1 GPU_REPORT="$out/bf16_report.json"
if [ "${GPU_WORKERS:-1}" -gt 1 ] && python3 -c "import xdist" 2>/dev/null; then
  parallel=$(echo " $tests " | sed "s# $SERIAL # #")
  : > "$out/gpu_tests.log"
  # shellcheck disable=SC2086 # a list of paths
  [ -n "${parallel// /}" ] && { OMP_NUM_THREADS=$(( $(nproc) / GPU_WORKERS )) python3 -m pytest -v -rf -s \
    -p no:cacheprovider -n "$GPU_WORKERS" --dist loadfile --ignore=$SERIAL $parallel > "$out/gpu_tests.log" 2>&1 || rc=1; }
  case " $tests " in
    *" tests/gpu "* | *" tests/gpu/ "* | *" $SERIAL "*)
      python3 -m pytest -v -rf -s -p no:cacheprovider $SERIAL >> "$out/gpu_tests.log" 2>&1 || rc=1 ;;
  esac
else
  [ "${GPU_WORKERS:-1}" -gt 1 ] && echo "gpu_check: pytest-xdist is missing (carry its wheel and execnet's in .whl): one process"
  # shellcheck disable=SC2086 # GPU_TESTS is a list of paths
  python3 -m pytest -v -rf -s -p no:cacheprovider $tests > "$out/gpu_tests.log" 2>&1 || rc=1
fi
grep -E "(FAILED|ERROR)( |$)|^(FAILED|ERROR) |^=+ .* in [0-9.]+s" "$out/gpu_tests.log" | tail -40
[ -n "${GPU_TESTS_ONLY:-}" ] && exit $rc
for dtype in bfloat16 float32; do
  python3 benchmarks/decode_speed.py --device cuda --dtype "$dtype" --json "$out/decode_$dtype.json" || rc=1
  python3 benchmarks/decode_speed.py --device cuda --dtype "$dtype" --no-cuda-graphs --json "$out/decode_${dtype}_eager.json" || rc=1
done
python3 benchmarks/miss_copy.py --json "$out/miss_copy.json" | tail -12 || rc=1
python3 benchmarks/copy_service.py --rows 1,2,8 --json "$out/copy_service.json" | tail -12 || rc=1
python3 benchmarks/moe_gemv.py --json "$out/moe_gemv.json" | tail -16 || rc=1
python3 benchmarks/grouped_gemm.py --json "$out/grouped_gemm.json" | tail -6 || rc=1
python3 benchmarks/quant_gemv.py --json "$out/quant_gemv.json" | tail -10 || rc=1
python3 benchmarks/cpu_experts.py --json "$out/cpu_experts.json" | tail -90 || rc=1
python3 benchmarks/dense_gemv.py --json "$out/dense_gemv.json" | tail -14 || rc=1
python3 benchmarks/router.py --json "$out/router.json" | tail -12 || rc=1
python3 benchmarks/ensure.py --json "$out/ensure.json" | tail -12 || rc=1
python3 benchmarks/paged_attention.py --json "$out/paged_attention.json" | tail -12 || rc=1
python3 benchmarks/gated_delta.py --json "$out/gated_delta.json" | tail -4 || rc=1
python3 benchmarks/ple.py --json "$out/ple.json" 2>&1 | tail -16 || rc=1
python3 benchmarks/prefill_stream.py --json "$out/prefill_stream.json" 2>&1 | tail -8 || rc=1
python3 benchmarks/fair_prefill.py --json "$out/fair_prefill.json" 2>&1 | tail -2 || rc=1
python3 -m edgemoe bench --geometry qwen3-30b-a3b --layers 8 --moe-cache-fraction 0.25,0.5,1 --routing-trace synthetic \
  --mode graph --profile 4 --json "$out/bench_qwen3_8layers.json" | tail -12 || rc=1
python3 -m edgemoe bench --geometry qwen3-30b-a3b --layers 8 --moe-strategy resident --prefill 512,4096 \
  --mode graph --steps 16 --warmup 8 --json "$out/bench_qwen3_8layers_prefill.json" 2>&1 | grep -E "^prefill|tok_s" | tail -8 || rc=1
python3 -m edgemoe bench --geometry qwen3-30b-a3b --layers 8 --vram-budget 4GiB --moe-policy lru --routing-trace synthetic \
  --mode graph --moe-cpu-compute off,auto,128 --moe-cpu-threads 8,16 --prefill 0 --json "$out/bench_qwen3_cpu_split.json" \
  | tail -8 || rc=1
exit $rc
