"""Miss copy on CUDA: the Triton kernel (`edgemoe.kernels.miss_copy`) against plain pinned host-to-device copies of
the same bytes, in one run, for expert-sized rows of real geometries.

    python benchmarks/miss_copy.py [--rows 8] [--json OUT]

Per geometry and weight kind (gate_up and down rows of one layer's pinned bank), `rows` random experts go to
random slots of a device pool. Compared: `memcpy` (one pinned `copy_` of rows x row bytes, contiguous: the
reference of the goal), `memcpy per row` (one `copy_` per listed row, the batched-cudaMemcpyAsync way, which needs
the list on the host), and the kernel over a device-side copy list for a sweep of block sizes and warps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from edgemoe.bench import timed
from edgemoe.kernels.miss_copy import BLOCK, copy_rows
from edgemoe.models.random_checkpoint import PRESETS
from edgemoe.moe.banks import allocate_bank


def seconds(fn, reps: int = 20) -> float:
    return timed(fn, torch.device("cuda"), reps)


def measure(experts: int, row_shape: tuple[int, int], rows: int, slots: int = 64) -> dict:
    bank = allocate_bank((experts, *row_shape), torch.bfloat16, pin=True)
    bank.view(torch.int16).random_()  # any bits (copies do not interpret them)
    pool = torch.empty(slots + 1, *row_shape, dtype=torch.bfloat16, device="cuda")
    src = torch.randperm(experts)[:rows]
    dst = torch.randperm(slots)[:rows]
    count = torch.tensor(rows, device="cuda")
    nbytes = rows * bank[0].numel() * bank.element_size()
    staged = bank[:rows].clone().pin_memory()  # the same bytes, contiguous and pinned
    target = torch.empty_like(staged, device="cuda")
    out = {"row_bytes": nbytes // rows, "rows": rows}
    out["memcpy"] = nbytes / seconds(lambda: target.copy_(staged, non_blocking=True))

    def per_row() -> None:
        for s, d in zip(src.tolist(), dst.tolist()):
            pool[d].copy_(bank[s], non_blocking=True)

    out["memcpy_per_row"] = nbytes / seconds(per_row)
    src_d, dst_d = src.cuda(), dst.cuda()
    copy_rows(pool, bank, src_d, dst_d, count)
    assert torch.equal(pool[dst_d].cpu().view(torch.int16), bank[src].view(torch.int16)), "wrong bytes copied"
    out["kernel"] = {}
    for block in (2048, BLOCK, 8192, 16384):
        for warps in (4, 8):
            rate = nbytes / seconds(lambda b=block, w=warps: copy_rows(pool, bank, src_d, dst_d, count, b, w))
            out["kernel"][f"block{block}_warps{warps}"] = rate
    default = out["kernel"][f"block{BLOCK}_warps4"]
    out["kernel_default_over_memcpy"] = default / out["memcpy"]
    out["kernel_best_over_memcpy"] = max(out["kernel"].values()) / out["memcpy"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8, help="experts per copy list (default: 8, top-k of qwen3)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b"):
        g = PRESETS[name]
        E, H, inter = g["num_experts"], g["hidden_size"], g["moe_intermediate_size"]
        for kind, shape in (("gate_up", (2 * inter, H)), ("down", (H, inter))):
            r = measure(E, shape, a.rows)
            results[f"{name}/{kind}"] = r
            best = max(r["kernel"], key=r["kernel"].get)
            kernel = r["kernel"][f"block{BLOCK}_warps4"]
            print(
                f"{name} {kind}: row {r['row_bytes'] / 2**20:.1f} MiB x {a.rows}: "
                f"memcpy {r['memcpy'] / 1e9:.1f} GB/s, per-row memcpy {r['memcpy_per_row'] / 1e9:.1f}, "
                f"kernel {kernel / 1e9:.1f} ({r['kernel_default_over_memcpy']:.3f} of memcpy; "
                f"best {best} {r['kernel_best_over_memcpy']:.3f})"
            )
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
