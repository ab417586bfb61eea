"""A running stream's inter-token latency while a long prompt prefills (#36, fair prefill): one request decodes, a
second arrives with a prompt of `--prompt` tokens, and the first request's token gaps are recorded before and while
the second prefills (the scheduler runs a decode step after every prefill chunk).

    python benchmarks/fair_prefill.py [--size small] [--prompt 16384] [--chunk 512] [--json OUT]

The model is random (`edgemoe make-model` preset `--size`, qwen3_moe, its context raised to fit the prompt), written
once into a temporary folder; on CUDA bf16 with graphs, elsewhere float32. Reported: p50 and p99 of the stream's gaps
before the long prompt arrived and while it prefilled, the prefill's chunks and its time to first token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from edgemoe import LLM, SamplingParams
from edgemoe.tools.make_model import make_model


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small", help="make-model preset (default small)")
    ap.add_argument("--prompt", type=int, default=16384, help="the long prompt's tokens (default 16384)")
    ap.add_argument("--chunk", type=int, default=512, help="--max-num-batched-tokens (default 512)")
    ap.add_argument("--before", type=int, default=32, help="stream tokens timed before the prompt arrives")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    folder = Path(tempfile.mkdtemp(prefix="edgemoe-fair-"))
    make_model(folder, "qwen3_moe", a.size, dtype="bfloat16" if cuda else "float32")
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"], a.prompt + 1024)
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), device="cuda" if cuda else "cpu", progress=False, max_num_seqs=2,
              max_model_len=a.prompt + 512, max_num_batched_tokens=a.chunk, prefix_cache=False)  # fmt: skip
    engine, vocab = llm.engine, config["vocab_size"]
    ids = torch.randint(vocab, (a.prompt + 16,), generator=torch.Generator().manual_seed(0)).tolist()
    stream = engine.add_request(ids[:16], SamplingParams(max_tokens=a.prompt, temperature=0, ignore_eos=True))
    stamps: list[tuple[float, str]] = []  # (time the stream got a token, phase)
    phase, long_req, first_token_at, arrived = "before", None, None, None
    while True:
        n = len(stream.output().token_ids)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if len(stream.output().token_ids) > n:
            stamps.append((now, phase))
        if long_req is None and sum(p == "before" for _, p in stamps) > a.before:
            arrived = time.perf_counter()
            long_req = engine.add_request(ids[16:], SamplingParams(max_tokens=1))
            phase = "during"
        if long_req is not None and first_token_at is None and long_req.output().token_ids:
            first_token_at = now
            break
    engine.abort(stream.request_id)
    gaps = {p: [(b - a_) * 1e3 for (a_, pa), (b, pb) in zip(stamps, stamps[1:]) if pa == pb == p]
            for p in ("before", "during")}  # fmt: skip
    result = {
        "size": a.size, "prompt": a.prompt, "chunk": a.chunk, "device": "cuda" if cuda else "cpu",
        "chunks": -(-a.prompt // a.chunk), "ttft_s": first_token_at - arrived,
        **{f"{p}_gap_ms_{name}": f(gaps[p]) for p in gaps for name, f in
           (("p50", statistics.median), ("p99", lambda xs: quantile(xs, 0.99)), ("max", max))},
        "stream_tokens_during": len(gaps["during"]) + 1,
    }  # fmt: skip
    r = result
    print(
        f"{a.size}, {a.prompt}-token prompt in {r['chunks']} chunks of {a.chunk}: TTFT {r['ttft_s']:.2f} s; the "
        f"running stream's gaps before p50 {r['before_gap_ms_p50']:.2f} / p99 {r['before_gap_ms_p99']:.2f} ms, "
        f"during p50 {r['during_gap_ms_p50']:.2f} / p99 {r['during_gap_ms_p99']:.2f} / max "
        f"{r['during_gap_ms_max']:.2f} ms ({r['stream_tokens_during']} tokens while it prefilled)",
        file=sys.stderr,
    )
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
