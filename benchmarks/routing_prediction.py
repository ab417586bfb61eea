"""How well can the next MoE layer's experts be guessed one layer early, so that their miss copy could start while
this layer computes (prefetch)? Measured on the demo model (CPU, float32, resident experts), decode only.

    python benchmarks/routing_prediction.py [--tokens 128] [--json FILE]

For each decode step and each MoE layer L but the last, three guesses of layer L+1's top-k, scored as the share of
its actual experts they contain (recall at k):
- `next_router`: layer L+1's router applied to layer L's MoE input (the normalised hidden state layer L routes on);
- `last_step`: the experts layer L+1 used at the previous step;
- `chance`: k / experts.
The prompts and sampling are `benchmarks/routing_traces.py`'s. The demo model is tiny (7 layers, 32 experts, top-4,
trained on a few MB of text): a data point for the design, not a figure for large models.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from edgemoe import LLM, SamplingParams
from edgemoe.engine.context import get_context
from edgemoe.moe.experts import Experts
from edgemoe.moe.layer import SparseMoE
from edgemoe.moe.router import route

sys.path.insert(0, str(Path(__file__).parent))
from routing_traces import PROMPTS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt (default: 128)")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args()
    llm = LLM(device="cpu", dtype="float32", progress=False)
    model = llm.engine.runner.model
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    cfg = model.config
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # this step's (MoE input, ids) per layer, in layer order

    def record(module: Experts, args: tuple) -> None:
        if not get_context().is_prefill:
            seen.append((args[0].detach().clone(), args[1].detach().clone()))

    for m in moes:
        m.experts.register_forward_pre_hook(record)
    hits = {"next_router": 0, "last_step": 0}
    total = 0
    for name, prompt, temperature in PROMPTS:
        engine = llm.engine
        params = SamplingParams(max_tokens=a.tokens, temperature=temperature, seed=1, ignore_eos=True)
        engine.add_request(prompt, params)
        previous = None
        while engine.has_unfinished():
            seen.clear()
            engine.step()
            if len(seen) != len(moes):
                previous = None
                continue  # a prefill step
            for layer in range(len(moes) - 1):
                x, _ = seen[layer]
                actual = set(seen[layer + 1][1].flatten().tolist())
                guess, _ = route(moes[layer + 1].gate(x), cfg.top_k, cfg.norm_topk_prob)
                hits["next_router"] += len(actual & set(guess.flatten().tolist()))
                if previous is not None:
                    hits["last_step"] += len(actual & set(previous[layer + 1][1].flatten().tolist()))
                total += len(actual)
            previous = list(seen)
        print(f"{name}: done", file=sys.stderr)
    steps_without_previous = len(PROMPTS) * (len(moes) - 1) * cfg.top_k  # each prompt's first decode step
    result = {
        "layers": len(moes),
        "experts": cfg.num_experts,
        "top_k": cfg.top_k,
        "decode_steps": total // ((len(moes) - 1) * cfg.top_k),
        "next_router": hits["next_router"] / total,
        "last_step": hits["last_step"] / (total - steps_without_previous),
        "chance": cfg.top_k / cfg.num_experts,
    }
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
