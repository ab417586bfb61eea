"""What batch invariance costs (README, "What is guaranteed"): decode steps at batch 1, 4 and 8 replayed from CUDA
graphs, and the prefill of several prompts in one step (the default scheduler) against one sequence a step
(`--batch-invariant`), on a random-weight model of a real geometry with every expert resident.

    python benchmarks/batch_invariance.py [--geometry qwen3-30b-a3b] [--layers 8] [--context 4096] [--json OUT]

Decode invariance has no switch (the kernels are the engine's), so its cost is measured by running this script against
two checkouts (PYTHONPATH=<older checkout> python benchmarks/batch_invariance.py) in one session, alternated. The
prefill figure compares the two scheduler policies in one run: prompts of `--prompt-tokens` each, `--prompts` of them,
chunked at the engine's default token budget.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from edgemoe.engine.activations import PREFILL_CHUNK
from edgemoe.engine.kv_cache import KVCache
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.engine.scheduler import Batch
from edgemoe.engine.sequence import Sequence
from edgemoe.sampling_params import SamplingParams
from edgemoe.tools.bench import BLOCK_SIZE, build_model
from edgemoe.tools.measure import timed

BATCHES = (1, 4, 8)


def decode_us(runner: ModelRunner, batch: int, context: int, reps: int) -> float:
    """µs per replayed decode step of `batch` sequences, each `context` tokens into its own blocks."""
    blocks = -(-(context + 1) // BLOCK_SIZE)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    ids = torch.randint(runner.model.config.vocab_size, (batch,)).tolist()
    slots = [t[context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE for t in tables]
    runner.decode.fill(ids, [context] * batch, slots, [context + 1] * batch, [0] * batch, tables)
    size = runner.graphs.size_for(batch)
    return timed(lambda: runner.graphs.replay(size), runner.device, reps) * 1e6


def prefill_s(runner: ModelRunner, prompts: int, tokens: int, budget: int, one_a_step: bool) -> float:
    """Seconds to prefill `prompts` random prompts of `tokens` each in chunks of the token budget: several sequences
    a step (the default scheduler's packing) or one (`batch_invariant`)."""
    blocks = -(-tokens // BLOCK_SIZE)
    seqs = []
    for i in range(prompts):
        seq = Sequence(torch.randint(runner.model.config.vocab_size, (tokens,)).tolist(), SamplingParams(), None, None)
        seq.block_table = list(range(i * blocks, (i + 1) * blocks))
        seqs.append(seq)
    torch.cuda.synchronize()
    start = time.perf_counter()
    while any(s.num_computed < tokens for s in seqs):
        room, chosen, num_new = budget, [], []
        for seq in seqs:
            n = min(tokens - seq.num_computed, room)
            if n <= 0 or (chosen and one_a_step):
                continue
            chosen.append(seq)
            num_new.append(n)
            room -= n
        runner.compute_logits(Batch(chosen, num_new, True))
        for seq, n in zip(chosen, num_new):
            seq.num_computed += n
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096, help="tokens in each sequence's KV for the decode steps")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", default="128,512", help="comma-separated prompt lengths for the prefill timing")
    ap.add_argument("--json")
    a = ap.parse_args()
    device = torch.device("cuda")
    lengths = [int(t) for t in a.prompt_tokens.split(",")]
    positions = max(a.context + 1, *lengths)
    model = build_model(a.geometry, a.layers, device, torch.bfloat16, positions, resident=True)
    seqs = max(max(BATCHES), a.prompts)
    blocks = seqs * -(-positions // BLOCK_SIZE)
    kv = KVCache(model.config, blocks, BLOCK_SIZE, torch.bfloat16, device)
    runner = ModelRunner(model, kv, device, max(BATCHES), -(-positions // BLOCK_SIZE))
    runner.capture_graphs(list(BATCHES))
    out = {"geometry": a.geometry, "layers": a.layers, "context": a.context, "decode_us": {}, "prefill_s": {}}
    for b in BATCHES:
        us = out["decode_us"][b] = decode_us(runner, b, a.context, a.reps)
        print(f"decode  batch {b}: {us:8.1f} µs a step, {b / us * 1e6:8.1f} tok/s")
    budget = PREFILL_CHUNK  # the engine's chunk with resident experts
    prefill_s(runner, 2, 64, budget, False)  # warm: cuBLAS handles, the grouped experts' first launches
    for tokens in lengths:
        packed, alone = (prefill_s(runner, a.prompts, tokens, budget, one) for one in (False, True))
        out["prefill_s"][tokens] = {"packed": packed, "one_a_step": alone}
        print(f"prefill {a.prompts} x {tokens} tokens (budget {budget}): packed {packed * 1e3:7.1f} ms, one a step "
              f"{alone * 1e3:7.1f} ms ({alone / packed:.2f}x)")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
