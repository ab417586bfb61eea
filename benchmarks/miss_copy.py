"""Miss copy on CUDA: the Triton kernel (`edgemoe.kernels.miss_copy`) against plain pinned host-to-device copies of
the same bytes, in one run, for expert-sized rows of real geometries.

    python benchmarks/miss_copy.py [--rows 8] [--bank-gib 16] [--sweep] [--json OUT]

Per geometry, `rows` random experts of one layer's pinned banks (gate_up and down, copied together in one launch as
`ExpertCache.copy_missing` does) go to random slots of a device pool. Compared: `memcpy` (one pinned `copy_` of the
same bytes, contiguous: the reference of the goal), `memcpy per row` (one `copy_` per listed row and bank, the
batched-cudaMemcpyAsync way, which needs the list on the host), and the kernel over a device-side copy list (with
`--sweep`: over persistent-grid sizes, programs per SM, block sizes and warps). Also: the cost of an empty list (every
expert hit: the launch that finds nothing to copy), timed from a CUDA graph of 50 launches; and the default kernel
on rows drawn from one large pinned bank (`--bank-gib`), as the engine's banks of every layer are, to show whether
the GPU's translation of scattered host pages costs bandwidth.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.kernels.miss_copy import BLOCK, PROGRAMS_PER_SM, copy_rows_pair
from edgemoe.offload.banks import allocate_bank
from edgemoe.tools.measure import timed
from edgemoe.tools.presets import PRESETS

GiB = 2**30


def seconds(fn, reps: int = 20) -> float:
    return timed(fn, torch.device("cuda"), reps)


def banks_of(experts: int, shapes: tuple) -> tuple[torch.Tensor, ...]:
    return tuple(allocate_bank((experts, *shape), torch.bfloat16, pin=True) for shape in shapes)


def measure(banks: tuple[torch.Tensor, ...], rows: int, sweep: bool, slots: int = 64) -> dict:
    experts = banks[0].shape[0]
    pools = tuple(torch.empty(slots + 1, *b.shape[1:], dtype=b.dtype, device="cuda") for b in banks)
    src = torch.randperm(experts)[:rows]
    dst = torch.randperm(slots)[:rows]
    for bank in banks:
        for s in src.tolist():
            bank[s].view(torch.int16).random_()  # the listed rows: any bits (copies do not interpret them)
    count = torch.tensor(rows, device="cuda")
    nbytes = rows * sum(b[0].numel() * b.element_size() for b in banks)
    out = {"row_bytes": nbytes // rows, "rows": rows, "bank_bytes": sum(b.numel() * b.element_size() for b in banks)}
    staged = torch.cat([b[src].flatten() for b in banks]).pin_memory()  # the same bytes, contiguous and pinned
    target = torch.empty_like(staged, device="cuda")
    out["memcpy"] = nbytes / seconds(lambda: target.copy_(staged, non_blocking=True))

    def per_row() -> None:
        for s, d in zip(src.tolist(), dst.tolist()):
            for pool, bank in zip(pools, banks):
                pool[d].copy_(bank[s], non_blocking=True)

    out["memcpy_per_row"] = nbytes / seconds(per_row)
    src_d, dst_d = src.cuda(), dst.cuda()
    copy_rows_pair(pools, banks, src_d, dst_d, count)
    for pool, bank in zip(pools, banks):
        assert torch.equal(pool[dst_d].cpu().view(torch.int16), bank[src].view(torch.int16)), "wrong bytes copied"
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    out["kernel"] = {}
    configs = [(p, b, w) for p in (1, 2, 4, 8) for b in (2048, 4096, 8192) for w in (4, 8)] if sweep else []
    for per_sm, block, warps in configs + [(PROGRAMS_PER_SM, BLOCK, 4)]:
        key = f"programs{per_sm}xSM_block{block}_warps{warps}"
        fn = lambda p=per_sm * sms, b=block, w=warps: copy_rows_pair(pools, banks, src_d, dst_d, count, None, b, w, p)  # noqa: E731
        out["kernel"][key] = nbytes / seconds(fn)
    default = out["kernel"][f"programs{PROGRAMS_PER_SM}xSM_block{BLOCK}_warps4"]
    out["kernel_default_over_memcpy"] = default / out["memcpy"]
    out["kernel_best"] = max(out["kernel"], key=out["kernel"].get)
    out["kernel_best_over_memcpy"] = out["kernel"][out["kernel_best"]] / out["memcpy"]
    empty = torch.zeros((), dtype=torch.long, device="cuda")

    def noop() -> None:
        for _ in range(50):
            copy_rows_pair(pools, banks, src_d, dst_d, empty)

    graph, _ = capture_graph(noop)
    out["empty_list_us"] = seconds(graph.replay) / 50 * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8, help="experts per copy list (default: 8, top-k of qwen3)")
    ap.add_argument("--bank-gib", type=float, default=16, help="the large bank's size (default: 16 GiB; 0: skip)")
    ap.add_argument("--sweep", action="store_true", help="time grid sizes x blocks x warps (slow)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/miss_copy.py needs a CUDA GPU")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    cases = []
    for name in ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b"):
        g = PRESETS[name]
        shapes = ((2 * g["moe_intermediate_size"], g["hidden_size"]), (g["hidden_size"], g["moe_intermediate_size"]))
        cases.append((name, g["num_experts"], shapes, a.sweep))
        if name == "qwen3-30b-a3b" and a.bank_gib:
            per_expert = 3 * shapes[0][0] * shapes[0][1]  # bf16 bytes of gate_up + down = 2 * 1.5 * 2I * H
            cases.append((f"{name} ({a.bank_gib:g} GiB bank)", int(a.bank_gib * GiB // per_expert), shapes, False))
    for name, experts, shapes, sweep in cases:
        r = measure(banks_of(experts, shapes), a.rows, sweep)
        results[name] = r
        kernel = r["kernel"][f"programs{PROGRAMS_PER_SM}xSM_block{BLOCK}_warps4"]
        print(
            f"{name}: expert {r['row_bytes'] / 2**20:.1f} MiB x {a.rows}: "
            f"memcpy {r['memcpy'] / 1e9:.1f} GB/s, per-row memcpy {r['memcpy_per_row'] / 1e9:.1f}, "
            f"kernel {kernel / 1e9:.1f} ({r['kernel_default_over_memcpy']:.3f} of memcpy; "
            f"best {r['kernel_best']} {r['kernel_best_over_memcpy']:.3f}); empty list {r['empty_list_us']:.2f} us"
        )
        torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
