#!/usr/bin/env bash
# Agent-loop time to first token per turn, with and without the prefix cache (issue #36): a random qwen3-30b-a3b
# checkpoint cut to $LAYERS layers, `edgemoe serve` on it once per run, `benchmarks/agent_loop.py --apis openai`
# against it, then one table. Runs from the repository root.
#
#   GPU machine:  bash benchmarks/agent_ttft.sh         (results in $OUT; a machine without the server's packages
#                 installs them from wheels in .whl-server/, which the caller brings)
#   CPU:          DEVICE=cpu PYTHON=.venv/bin/python bash benchmarks/agent_ttft.sh   (toy size, same steps)
#
# Knobs (environment): DEVICE cuda|cpu, PYTHON, OUT, FAMILY and SIZE (make-model's: qwen3_moe and qwen3-30b-a3b;
# cpu: small; FAMILY=qwen3_5_moe_text SIZE=qwen3.5-35b-a3b runs a hybrid, whose turns resume from state snapshots),
# LAYERS (4; cpu: 3), TURNS (6), MAX_TOKENS (128; cpu: 32), BUDGET (the offloaded runs' --vram-budget, default
# LAYERS x 600 + 2600 MiB), RUNS (default "offload:on offload:off resident:on resident:off"; on/off: the prefix cache),
# DEADLINE (240 s, cpu 480: a run that would start after DEADLINE - 45 s is skipped),
# MODEL_DIR (an existing checkpoint there is reused).
set -uo pipefail
START=$SECONDS
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/agent_ttft_out}
TURNS=${TURNS:-6}
RUNS=${RUNS:-"offload:on offload:off resident:on resident:off"}
mkdir -p "$OUT" && : >"$OUT/serve.log"
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
log() { echo "[$((SECONDS - START)) s] $*"; }

# 1. the server's and the client's packages (the GPU machine has none of fastapi, uvicorn, pydantic, openai, gguf)
if ! $PY -c "import fastapi, uvicorn, pydantic, openai, gguf" 2>/dev/null; then
  log "installing .whl-server/*.whl into /tmp/site"
  timeout 120 $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-server/*.whl || exit 1
fi
$PY -c "import fastapi, uvicorn, pydantic, openai, gguf, torch, edgemoe
print('torch', torch.__version__, '| cuda', torch.cuda.is_available(), '| edgemoe', edgemoe.__file__)" || exit 1

# 2. the checkpoint and the flags of each kind of run
if [ "$DEVICE" = cpu ]; then
  MODEL=${MODEL_DIR:-/tmp/agent_ttft_model_cpu}; LAYERS=${LAYERS:-3}; MAX_TOKENS=${MAX_TOKENS:-32}; DEADLINE=${DEADLINE:-480}
  MAKE="--family ${FAMILY:-qwen3_moe} --size ${SIZE:-small} --layers $LAYERS --dtype float32"
  COMMON="--device cpu --max-model-len 4096 --max-num-seqs 2"
  OFFLOAD="--moe-strategy offload --moe-cache-slots 64"  # 2 of 3 layers of 32 experts: streamed prefill
else
  MODEL=${MODEL_DIR:-/tmp/agent_ttft_model}; LAYERS=${LAYERS:-4}; MAX_TOKENS=${MAX_TOKENS:-128}; DEADLINE=${DEADLINE:-240}
  MAKE="--family ${FAMILY:-qwen3_moe} --size ${SIZE:-qwen3-30b-a3b} --layers $LAYERS --dtype bfloat16"
  COMMON="--device cuda --max-model-len 16384 --max-num-seqs 2"
  # dense 1.24 GB + 38 MB a layer, KV 2 MB a layer per 1K tokens, a layer's experts 1.2 GB: at 3-8 layers the budget
  # caches 2.3-4.4 layers' worth of experts (at least two, so that prefill streams whole layers; not all of them)
  OFFLOAD="--moe-strategy offload --vram-budget ${BUDGET:-$((LAYERS * 600 + 2600))MiB}"
fi
if [ ! -f "$MODEL/config.json" ]; then
  log "make-model $MAKE -> $MODEL"
  timeout 180 $PY -m edgemoe make-model "$MODEL" $MAKE || exit 1
  # the agent loop sends tools: dress the checkpoint as a Qwen3-style tool-calling model as the server tests do (the
  # demo tokenizer with <tool_call> etc. as whole tokens, a chat template with tools)
  $PY - "$MODEL" <<'EOF' || exit 1
import shutil, sys, tempfile
from pathlib import Path
from benchmarks.scripted_server import QWEN3_TEMPLATE, QWEN_TOKENS, make_model
with tempfile.TemporaryDirectory() as tmp:
    dressed = make_model(Path(tmp) / "m", QWEN3_TEMPLATE, QWEN_TOKENS)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(dressed / name, Path(sys.argv[1]) / name)
EOF
  du -sh "$MODEL"
fi

# 3. one server a run: start, wait for /health, the agent loop, stop
health() {  # port, seconds -> 0 once /health answers 200
  $PY - "$1" "$2" <<'EOF'
import sys, time, urllib.request
port, end = sys.argv[1], time.time() + float(sys.argv[2])
while time.time() < end:
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit(1)
EOF
}
port=8790
for run in $RUNS; do
  kind=${run%%:*}; cache=${run##*:}; name="${kind}_cache_${cache}"
  if [ $((SECONDS - START)) -gt $((DEADLINE - 45)) ]; then log "skip $name: past the deadline"; continue; fi
  flags="$COMMON"
  [ "$kind" = offload ] && flags="$flags $OFFLOAD"
  [ "$cache" = off ] && flags="$flags --no-prefix-cache"
  port=$((port + 1))
  log "serve $name: $flags"
  echo "===== $name: $flags" >>"$OUT/serve.log"
  timeout 200 $PY -m edgemoe serve --model "$MODEL" --port $port $flags >>"$OUT/serve.log" 2>&1 &
  pid=$!
  if health $port 150; then
    log "ready; agent loop"
    timeout 120 $PY benchmarks/agent_loop.py --url http://127.0.0.1:$port --apis openai --turns "$TURNS" \
      --max-tokens "$MAX_TOKENS" --json "$OUT/$name.json" >"$OUT/$name.txt" 2>&1 || log "agent loop failed: $(tail -3 "$OUT/$name.txt")"
  else
    log "no /health in 150 s: $(tail -3 "$OUT/serve.log")"
  fi
  kill -TERM $pid 2>/dev/null
  wait $pid 2>/dev/null
  rm -f "$OUT/$name.txt"
done

# 4. one table: per turn, prompt tokens, cached tokens and the server's TTFT of each run
$PY - "$OUT" $RUNS <<'EOF'
import json, os, sys
out, runs = sys.argv[1], sys.argv[2:]
names = [r.replace(":", "_cache_") for r in runs]
turns = {n: json.load(open(f"{out}/{n}.json")) for n in names if os.path.exists(f"{out}/{n}.json")}
turns = {n: t if isinstance(t, list) else t.get("turns", t) for n, t in turns.items()}
for line in open(f"{out}/serve.log"):
    if line.startswith("=====") or "prefill: chunks" in line or "expert cache:" in line or "KV cache:" in line:
        print(line.rstrip()[:220])
if not turns:
    sys.exit("no run finished")
width = max(len(t) for t in turns.values())
print("     | " + " | ".join(f"{n:^24}" for n in turns))
print("turn | " + " | ".join(f"{'prompt':>6} {'cached':>6} {'TTFT ms':>10}" for _ in turns))
for i in range(width):
    cells = []
    for n, t in turns.items():
        r = t[i] if i < len(t) else None
        cells.append(f"{'-':>24}" if r is None else f"{r['prompt_tokens']:>6} {r['cached_tokens']:>6} {r['ttft_ms']:>10.1f}")
    print(f"{i + 1:>4} | " + " | ".join(cells))
EOF
log "done"
