"""Decode throughput of the engine (eager): tok/s at batch 1 and 4, with prefill excluded.

    python benchmarks/decode_speed.py --device cuda --dtype bfloat16 [--model PATH] [--json OUT]

Measures whole engine steps (scheduler + inputs + model + sampler + detokeniser), the cost a user sees.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from edgemoe import LLM, SamplingParams

PROMPTS = ["ROMEO.\n", "Of Man's first disobedience", "To be, or not to be", "KING.\nWhat news?"]


def decode_rate(llm: LLM, batch: int, tokens: int) -> float:
    engine = llm.engine
    for p in PROMPTS[:batch]:
        engine.add_request(p, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()  # prefill
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished():
        produced += len(engine.step())
    return produced / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    ap.add_argument("--json")
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, progress=False, cuda_graphs=args.cuda_graphs)
    decode_rate(llm, 1, 8)  # warm-up
    rows = {f"batch{b}": round(decode_rate(llm, b, args.tokens), 1) for b in (1, 4)}
    result = {
        "model": args.model or "demo",
        "device": args.device,
        "dtype": str(llm.engine.dtype),
        "cuda_graphs": llm.engine.runner.graphs is not None,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "decode_tok_s": rows,
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
