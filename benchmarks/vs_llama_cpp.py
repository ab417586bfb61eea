"""edgemoe against llama.cpp on the same GGUF file, the same GPU, in one run: decode tok/s, prefill (time to first
token) and the GPU memory each holds, resident and under memory limits.

    python benchmarks/vs_llama_cpp.py --model FILE.gguf [--budgets 2GiB,3GiB] [--llama-bench PATH --ncmoe 0,2,4]
        [--prompt 500] [--tokens 128] [--json OUT]

- edgemoe, each configuration in its own process (its memory alone): `LLM.stream` end to end (scheduler, runner,
  sampler, detokeniser), two requests of `--prompt` random token ids, `--tokens` greedy tokens each; per request the
  time to first token (the prompt's prefill: prompt / TTFT tok/s) and the decode rate after it. The second request
  is reported (the first pays one-time costs: graph capture replays, cold caches). GPU memory: torch's peak
  allocation while loading and while serving, and the device's used memory (NVML's view through
  `torch.cuda.mem_get_info`, CUDA context included) at its peak. `resident` keeps every expert on the GPU; a budget
  runs `--vram-budget` with offloaded experts.
- llama.cpp: `llama-bench -ngl 99 -fa 1 -p PROMPT -n TOKENS -ncmoe N` (N layers' experts on the CPU; 0: all on the
  GPU), tokens/s of pp and tg as it reports them; its GPU memory is the CUDA buffers it prints when loading
  (model, KV, compute: `-v`).

llama.cpp as measured (RESULTS.md): the llama-cpp-python sdist's `vendor/llama.cpp` configured with `-DGGML_CUDA=ON
-DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON`, targets `llama-bench`, `llama-quantize`,
`ggml-cuda` and the CPU variants; run with its folder and cuBLAS 13's on `LD_LIBRARY_PATH` and the driver's libcuda in
`LD_PRELOAD` where the build linked a stub (else the CUDA backend fails to load, silently, and everything runs on the
CPU: check for "CUDA0 model buffer" in its log). On the H100 machine its sapphirerapids CPU variant died of SIGILL;
without it the loader took zen4's.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

MiB = 2**20


def run_edgemoe(model: str, budget: str, prompt: int, tokens: int, fit_kv: bool = False) -> dict:
    """One configuration (`budget`: "resident" or a --vram-budget), in this process. `fit_kv`: a KV cache of one
    sequence's tokens (`kv_cache_tokens`), as llama-bench sizes its context; else the engine's own share."""
    from edgemoe import LLM, SamplingParams

    opts = {} if budget == "resident" else dict(moe_strategy="offload", vram_budget=budget)
    if fit_kv:
        opts["kv_cache_tokens"] = prompt + tokens + 16
    start = time.perf_counter()
    llm = LLM(model, device="cuda", progress=False, max_num_seqs=1, max_model_len=prompt + tokens + 16, **opts)
    load = time.perf_counter() - start
    load_peak = torch.cuda.max_memory_allocated()  # loading's transients included
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    runs, peak_used = [], 0
    for _ in range(2):
        ids = torch.randint(100, vocab - 100, (prompt,), generator=gen).tolist()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = last = None
        n = 0
        for out in llm.stream(ids, params):
            now = time.perf_counter()
            if first is None and out.token_ids:
                first = now
            n = len(out.token_ids)
            last = now
        free, total = torch.cuda.mem_get_info()
        peak_used = max(peak_used, total - free)
        ttft = first - t0
        runs.append({"ttft_s": ttft, "prefill_tok_s": prompt / ttft, "decode_tok_s": (n - 1) / (last - first)})
    cache = llm.engine.expert_cache
    return {
        "config": budget,
        "load_s": load,
        "runs": runs,
        "peak_allocated_mib": torch.cuda.max_memory_allocated() / MiB,  # serving the two requests
        "load_peak_allocated_mib": load_peak / MiB,
        "peak_used_mib": peak_used / MiB,
        "cached_experts": None if cache is None else cache.num_slots,
        "start_line": getattr(llm.engine, "memory_line", None),
    }


def edgemoe_in_subprocess(model: str, budget: str, prompt: int, tokens: int, fit_kv: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--one", budget, "--model", model]
    cmd += ["--prompt", str(prompt), "--tokens", str(tokens)]
    cmd += ["--fit-kv"] if fit_kv else []
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in done.stderr.splitlines() if line.startswith("edgemoe:")]  # its start-up lines
    if done.returncode:
        return {"config": budget, "error": done.stderr.strip().splitlines()[-1:], "lines": lines}
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"lines": lines}


_BUFFER = re.compile(r"CUDA0 (model|KV|compute|RS) buffer size\s*=\s*([\d.]+) MiB")


def run_llama(bench: str, model: str, ncmoe: int, prompt: int, tokens: int) -> dict:
    cmd = [bench, "-m", model, "-ngl", "99", "-fa", "1", "-p", str(prompt), "-n", str(tokens), "-r", "3",
           "-ncmoe", str(ncmoe), "-o", "json", "-v"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        return {"ncmoe": ncmoe, "error": (done.stderr or done.stdout).strip().splitlines()[-3:]}
    rows = json.loads(done.stdout)
    buffers: dict[str, float] = {}
    for kind, mib in _BUFFER.findall(done.stderr):
        buffers[kind] = max(buffers.get(kind, 0.0), float(mib))
    out = {"ncmoe": ncmoe, "gpu_buffers_mib": sum(buffers.values()), "buffers": buffers}
    for r in rows:
        key = "prefill_tok_s" if r.get("n_prompt") else "decode_tok_s"
        out[key] = r["avg_ts"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--budgets", default="", help="edgemoe --vram-budget values beside resident, e.g. 2GiB,3GiB")
    ap.add_argument(
        "--no-resident", action="store_true", help="skip edgemoe's resident run (a model that does not fit)"
    )
    ap.add_argument("--llama-bench", help="path of llama.cpp's llama-bench (none: edgemoe only)")
    ap.add_argument("--ncmoe", default="0", help="llama.cpp -ncmoe values")
    ap.add_argument("--prompt", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--fit-kv", action="store_true", help="edgemoe's KV cache: one sequence's tokens (llama-bench's)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # one edgemoe configuration, in this process
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_edgemoe(a.model, a.one, a.prompt, a.tokens, a.fit_kv)))
        return
    res = {"device": torch.cuda.get_device_name(), "model": a.model, "prompt": a.prompt, "tokens": a.tokens}
    configs = ([] if a.no_resident else ["resident"]) + [b for b in a.budgets.split(",") if b]
    res["edgemoe"] = [edgemoe_in_subprocess(a.model, c, a.prompt, a.tokens, a.fit_kv) for c in configs]
    res["llama.cpp"] = []
    if a.llama_bench:
        res["llama.cpp"] = [run_llama(a.llama_bench, a.model, int(n), a.prompt, a.tokens) for n in a.ncmoe.split(",")]
    print(f"{res['device']}, {Path(a.model).name}: prompt {a.prompt}, {a.tokens} tokens")
    for r in res["edgemoe"]:
        if "error" in r:
            print(f"edgemoe {r['config']}: {r['error']}")
            continue
        last = r["runs"][-1]
        print(f"edgemoe {r['config']}: decode {last['decode_tok_s']:.1f} tok/s, prefill {last['prefill_tok_s']:.0f} "
              f"tok/s (TTFT {last['ttft_s'] * 1e3:.0f} ms), peak allocated {r['peak_allocated_mib']:.0f} MiB, used "
              f"{r['peak_used_mib']:.0f} MiB, experts cached {r['cached_experts']}")  # fmt: skip
    for r in res["llama.cpp"]:
        if "error" in r:
            print(f"llama.cpp -ncmoe {r['ncmoe']}: {r['error']}")
            continue
        print(f"llama.cpp -ncmoe {r['ncmoe']}: decode {r.get('decode_tok_s', 0):.1f} tok/s, prefill "
              f"{r.get('prefill_tok_s', 0):.0f} tok/s, GPU buffers {r['gpu_buffers_mib']:.0f} MiB")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
