"""Record routing traces from the demo model and replay them with `edgemoe cache-sim` at 25/50/75 % of all experts.

    python benchmarks/routing_traces.py --out /tmp/traces [--tokens 256]

Each trace is one sequence's decode (`--record-routing`), resident experts, sampled at temperature 0.8 with a
fixed seed (one greedy); the prompts are openings in the style of the demo model's training text. Prints a
Markdown table of hit rates (lru, scored, belady) per trace and cache size, and their mean; then the same for
synthetic traces (`edgemoe.tools.cache_sim.synthetic_trace`: Zipf popularity, temporal repeats) of 8 layers x 64
experts, top-6.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from edgemoe import LLM, SamplingParams
from edgemoe.tools.cache_sim import load_trace, run, simulate, synthetic_trace

PROMPTS = [
    ("greedy", "To be, or not to be, that is the question:", 0.0),
    ("hamlet", "HAMLET. O, that this too too solid flesh would melt,", 0.8),
    ("milton", "Of Man's first disobedience, and the fruit\nOf that forbidden tree", 0.8),
    ("king", "KING. Now is the winter of our discontent", 0.8),
    ("scene", "SCENE II. A room in the castle.\n\nEnter", 0.8),
    ("sonnet", "Shall I compare thee to a summer's day?", 0.8),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the .npy traces")
    ap.add_argument("--tokens", type=int, default=256, help="tokens generated per trace (default: 256)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (name, prompt, temperature) in enumerate(PROMPTS):
        path = a.out / f"demo-{name}.npy"
        llm = LLM(progress=False, max_num_seqs=1, record_routing=str(path))
        llm.generate(prompt, SamplingParams(max_tokens=a.tokens, temperature=temperature, seed=i, ignore_eos=True))
        paths.append(path)
    trace = load_trace(paths[0])
    total = trace.shape[1] * 32  # the demo model: 32 experts per MoE layer
    print("| trace | steps | slots | lru | scored | belady |\n|---|---|---|---|---|---|")
    means: dict[int, list] = {}
    for path in paths:
        steps = load_trace(path).shape[0]
        for frac in (0.25, 0.5, 0.75):
            slots = round(frac * total)
            r = run(path, slots, ["lru", "scored", "belady"])
            rates = [r[p]["hit_rate"] for p in ("lru", "scored", "belady")]
            means.setdefault(slots, []).append(rates)
            print(f"| {path.stem} | {steps} | {slots} ({frac:.0%}) | " + " | ".join(f"{x:.3f}" for x in rates) + " |")
    for slots, rows in means.items():
        mean = [sum(col) / len(col) for col in zip(*rows)]
        print(f"| mean | | {slots} ({slots / total:.0%}) | " + " | ".join(f"**{x:.3f}**" for x in mean) + " |")
    synthetic = {
        "zipf 1.0, repeat 0.3": synthetic_trace(400, 8, 64, 6, 1.0, 0.3, seed=1),
        "zipf 0.6, repeat 0.6": synthetic_trace(400, 8, 64, 6, 0.6, 0.6, seed=2),
        "uniform": synthetic_trace(400, 8, 64, 6, 0.0, 0.0, seed=3),
        "zipf 1.2, drift at half": np.concatenate(
            [synthetic_trace(200, 8, 64, 6, 1.2, 0.3, seed=4), synthetic_trace(200, 8, 64, 6, 1.2, 0.3, seed=5)]
        ),
    }
    print("\n| synthetic trace | slots | lru | scored | belady |\n|---|---|---|---|---|")
    for name, trace in synthetic.items():
        for frac in (0.25, 0.5, 0.75):
            slots = round(frac * 8 * 64)
            rates = [simulate(trace, slots, p)["hit_rate"] for p in ("lru", "scored", "belady")]
            print(f"| {name} | {slots} ({frac:.0%}) | " + " | ".join(f"{x:.3f}" for x in rates) + " |")


if __name__ == "__main__":
    main()
