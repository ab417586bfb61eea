"""Prompt-lookup speculative decoding (`--speculative ngram`) against plain decoding on one model, in one run: greedy
decode tok/s of each, the drafts' acceptance and tokens per verify step, and whether the outputs are identical (they
must be).

    python benchmarks/speculative.py [--model PATH] [--device cpu|cuda] [--tokens 128] [--draft 2,4,8] [--repeats 3]
                                     [--json OUT]

The prompt is a passage the model is likely to copy: a Shakespeare speech given twice and begun a third time (the demo
model was trained on Shakespeare), so drafts come from the prompt itself, as an agent's copy of a file it read does.
Each configuration runs `--repeats` times after one warm-up request; the median request is reported (decode rate:
(output tokens - 1) / (last token - first token), time to first token apart). One sequence; `max_num_seqs` is 1 + the
draft length, the rows a verify step takes."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from edgemoe import LLM, SamplingParams

PASSAGE = (
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\nThe slings and arrows "
    "of outrageous fortune,\nOr to take arms against a sea of troubles\nAnd by opposing end them. To die: to sleep;\n"
    "No more; and by a sleep to say we end\nThe heart-ache and the thousand natural shocks\nThat flesh is heir to.\n\n"
)


def timed(llm: LLM, prompt: str, params: SamplingParams) -> tuple[list[int], float]:
    """(output ids, decode tok/s after the first token)."""
    stamps, ids = [], []
    for out in llm.stream(prompt, params):
        stamps.append((time.perf_counter(), len(out.token_ids)))
        ids = out.token_ids
    (t0, n0), (t1, n1) = stamps[0], stamps[-1]
    return ids, (n1 - n0) / (t1 - t0) if t1 > t0 else float("nan")


def run(model: str | None, device: str, draft: int, prompt: str, params: SamplingParams, repeats: int) -> dict:
    opts = dict(device=device, progress=False, max_num_seqs=1 + draft)  # a verify step's rows: one a position
    if draft:
        opts |= dict(speculative="ngram", speculative_tokens=draft)
    llm = LLM(model, **opts)
    timed(llm, prompt, params)  # warm-up
    results = [timed(llm, prompt, params) for _ in range(repeats)]
    spec = llm.engine.speculative.as_dict()
    return {"draft": draft, "ids": results[0][0], "tok_s": statistics.median(r[1] for r in results), **spec}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--draft", default="2,4,8", help="comma-separated draft lengths, each a run beside plain decoding")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    prompt = PASSAGE * 2 + PASSAGE[:60]
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    plain = run(a.model, a.device, 0, prompt, params, a.repeats)
    rows = [plain]
    print(f"plain decode: {plain['tok_s']:.1f} tok/s")
    for k in (int(v) for v in a.draft.split(",") if v):
        r = run(a.model, a.device, k, prompt, params, a.repeats)
        r["speedup"], r["identical"] = r["tok_s"] / plain["tok_s"], r["ids"] == plain["ids"]
        rows.append(r)
        rate, per_step = r["acceptance"] or 0.0, r["tokens_per_step"] or 1.0
        print(f"ngram, {k} drafts: {r['tok_s']:.1f} tok/s ({r['speedup']:.2f}x), acceptance {rate:.2f}, "
              f"{per_step:.2f} tokens a verify step, output identical: {r['identical']}")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"device": a.device, "model": a.model or "demo", "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
