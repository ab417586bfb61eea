"""`edgemoe bench` with the decode path changed in one place, for A/B figures in one session
(benchmarks/RESULTS.md) without switches in the engine:

    python benchmarks/decode_variants.py --gemv plain --copy-programs-per-sm 8 -- --geometry qwen3-30b-a3b ...

- `--gemv plain`: the expert GEMV waits for the whole miss copy (the engine before per-pair arrivals,
  `edgemoe.kernels.miss_copy.Arrivals`); `streamed` (default): the engine's.
- `--miss-copy sm`: the rows copied by SMs reading pinned memory (the Triton `copy_rows_pair`, the engine before
  its copy service, `edgemoe.moe.copy_service`); `service` (default): the engine's.
- `--copy-batch-group G`: the copy service's entries per `cuMemcpyBatchAsync` (0: a `cuMemcpyHtoDAsync` per row;
  default: the engine's `BATCH_GROUP`).
- `--copy-programs-per-sm`: the miss copy's persistent grid (default: the engine's `PROGRAMS_PER_SM`).
- `--no-pdl`: ordinary launches everywhere, so that `--profile`'s per-kernel table shows each kernel's own time
  (under PDL a kernel's time includes its wait for the one before); also what GPUs before Hopper run.
- `--norm-gemv`: the pre-attention add + RMSNorm inside the qkv GEMV (`edgemoe.kernels.dense_gemv.norm_gemv`):
  `auto` the engine's choice (only without PDL), `off` never, `on` always (launched with PDL where there is
  PDL), `ordinary` always, launched with an ordinary dependency on the kernel before, `on-spacer` always, after
  a one-program kernel that only waits for the MoE down GEMV (`spaced`: qkv's programs are then placed on the SMs
  once down has finished, not while its last programs run). `--norm-gemv-stages N`: its loop steps in flight
  (the engine's: `dense_gemv.STAGES`; fewer stages, less shared memory a program).
- `--ensure-block-s N`, `--ensure-warps W`: the fused `ensure`'s slots per step of its key pass and its warps
  (the engine's: `ensure.BLOCK_S`, `ensure.NUM_WARPS`).
- `--up-rows N`, `--up-warps W`: gate (and up) rows a program of the MoE up GEMV and its warps (the engine's
  `pick_blocks`: 16 and 8 at qwen3-30b-a3b).
- `--down-rows N`: output rows a program of the MoE down GEMV (the engine's `pick_blocks`: 1); `--down-k N`,
  `--up-k N`: columns a loop step of the down and up GEMVs (the engine's: 128 and 128 at qwen3-30b-a3b);
  `--up-stages N`, `--down-stages N`: their loop steps in flight (the engine's: 4 and 1);
  `--down-ordinary-launch`: the down GEMV launched with an ordinary dependency instead of PDL; `--down-spacer`:
  after a one-program kernel that only waits for up (its programs placed once up has finished).
- `--no-ensure-prefetch`: `ensure` does not ask L2 for the layer's `slot_of` row (and `freq`, `last`) before its
  PDL wait (`ensure.PREFETCH`).
- `--separate-post`: a post kernel after `ensure` posts the copy list to the copy service, instead of `ensure`
  itself once its victims are chosen (`ensure.FUSED_POST`).
- `--attention-warps W`, `--attention-stages S`: the paged-attention partial kernel's warps and pipeline stages
  (the engine's: `paged_attention.WARPS`, `paged_attention.STAGES`); `--attention-prefetch-tiles N`: tiles of K and
  V a partial program asks into L2 before its PDL wait (`paged_attention.PREFETCH_TILES`, the engine's 1; 0: none);
  `--attention-min-tiles N`: tiles a split holds at least (0: the engine's `paged_attention.min_split_tiles`).
- `--no-prologue-early-trigger`: the attention prologue triggers paged attention only after its own wait for qkv,
  instead of before it (`norm_rope.PROLOGUE_EARLY_TRIGGER`, the engine's), so attention's early reads overlap only
  the prologue.
- `--dense-config OUTxIN=nB_kK_wW_sS` (repeatable): the dense GEMV of that weight shape (e.g. qwen3-30b-a3b's o,
  `2048x4096`) with BLOCK_N B, BLOCK_K K, W warps and S stages instead of the engine's (`dense_gemv.pick_block_n`,
  `BLOCK_K`, `WARPS`, `STAGES`).
- `--smem-carveout P`: every Triton kernel's preferred shared-memory carveout set to P percent (benchmarks/
  smem_carveout.py), before its first launch.
- `--pin-core N`: the main thread (it replays the graphs and serves their copy lists) kept on core N, from after
  CUDA has started (the driver's own threads, started with it, keep every core).

Everything after `--` goes to `edgemoe bench`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable

import edgemoe.moe.copy_service as copy_service
import torch
import triton
import triton.language as tl
from edgemoe.moe.expert_cache import ExpertCache

import edgemoe.kernels.dense_gemv as dense_gemv
import edgemoe.kernels.ensure as ensure
import edgemoe.kernels.miss_copy as miss_copy
import edgemoe.kernels.moe_gemv as moe_gemv
import edgemoe.kernels.norm_rope as norm_rope
import edgemoe.kernels.paged_attention as paged_attention
import edgemoe.kernels.pdl as pdl
from edgemoe.cli import main as edgemoe_main
from edgemoe.kernels.pdl import wait_for_inputs
from edgemoe.models.decoder import SelfAttention


def ordinary_launches(module, fn: Callable) -> Callable:
    """`fn`, whose kernels take `module.launch_args`, launched without PDL (their wait instruction stays, a no-op)."""
    args = module.launch_args

    def run(*a, **k):
        module.launch_args = lambda device: {**args(device), "launch_pdl": False}
        try:
            return fn(*a, **k)
        finally:
            module.launch_args = args

    return run


@triton.jit
def _spacer(PDL: tl.constexpr):
    wait_for_inputs(PDL)


def spaced(fn: Callable) -> Callable:
    """`fn` after a one-program kernel that only waits for the kernel before it (PDL): `fn`'s programs are then
    placed on the SMs once that kernel has finished, not while its last programs still run."""

    def run(x, *a, **k):
        _spacer[(1,)](**pdl.launch_args(x.device))
        return fn(x, *a, **k)

    return run


def parse_dense_config(text: str) -> tuple[tuple[int, int], dict]:
    """'2048x4096=n4_k512_w4_s4' -> ((2048, 4096), gemv's keywords); the config's name as dense_gemv.py's."""
    from dense_gemv import parse_config  # benchmarks/dense_gemv.py (this folder), not the kernel module

    try:
        shape, config = text.split("=")
        out_features, in_features = (int(v) for v in shape.split("x"))
    except ValueError:
        example = "2048x4096=n4_k512_w4_s4"
        raise SystemExit(f"--dense-config {text!r}: expected OUTxIN=nB_kK_wW_sS, e.g. {example}") from None
    block_n, block_k, warps, stages = parse_config(config, "--dense-config")
    return (out_features, in_features), dict(block_n=block_n, block_k=block_k, warps=warps, stages=stages)


def configured_gemv(gemv: Callable, configs: dict) -> Callable:
    """`gemv` with the keywords of `configs[(out, in)]` for weights of that shape (DecodeLinear looks the function
    up in its module at each call)."""

    def run(x, weight, bias=None, **kw):
        return gemv(x, weight, bias, **{**configs.get(tuple(weight.shape), {}), **kw})

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemv", choices=["streamed", "plain"], default="streamed")
    ap.add_argument("--miss-copy", choices=["service", "sm"], default="service")
    ap.add_argument("--copy-batch-group", type=int, default=copy_service.BATCH_GROUP)
    ap.add_argument("--copy-programs-per-sm", type=int, default=miss_copy.PROGRAMS_PER_SM)
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--norm-gemv", choices=["auto", "off", "on", "on-spacer", "ordinary"], default="auto")
    ap.add_argument("--norm-gemv-stages", type=int, default=dense_gemv.STAGES)
    ap.add_argument("--up-rows", type=int, default=0, help="0: the engine's")
    ap.add_argument("--up-warps", type=int, default=0, help="0: the engine's")
    ap.add_argument("--down-rows", type=int, default=0, help="0: the engine's")
    ap.add_argument("--down-k", type=int, default=0, help="0: the engine's")
    ap.add_argument("--up-k", type=int, default=0, help="0: the engine's")
    ap.add_argument("--up-stages", type=int, default=0, help="0: the engine's")
    ap.add_argument("--down-stages", type=int, default=0, help="0: the engine's")
    ap.add_argument("--down-ordinary-launch", action="store_true")
    ap.add_argument("--down-spacer", action="store_true")
    ap.add_argument("--ensure-block-s", type=int, default=ensure.BLOCK_S)
    ap.add_argument("--ensure-warps", type=int, default=ensure.NUM_WARPS)
    ap.add_argument("--no-ensure-prefetch", action="store_true")
    ap.add_argument("--separate-post", action="store_true")
    ap.add_argument("--attention-warps", type=int, default=paged_attention.WARPS)
    ap.add_argument("--attention-stages", type=int, default=paged_attention.STAGES)
    ap.add_argument("--attention-prefetch-tiles", type=int, default=paged_attention.PREFETCH_TILES)
    ap.add_argument("--attention-min-tiles", type=int, default=0, help="0: the engine's")
    ap.add_argument("--no-prologue-early-trigger", action="store_true")
    ap.add_argument("--pin-core", type=int, default=None)
    ap.add_argument("--dense-config", action="append", default=[], metavar="OUTxIN=nB_kK_wW_sS")
    ap.add_argument("--smem-carveout", type=int, default=None, metavar="PERCENT")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the arguments of `edgemoe bench`")
    a = ap.parse_args()
    if a.copy_programs_per_sm < 1:
        raise SystemExit("--copy-programs-per-sm must be >= 1")
    if a.ensure_block_s < 1 or a.ensure_block_s & (a.ensure_block_s - 1) or a.ensure_warps < 1:
        raise SystemExit("--ensure-block-s must be a power of two and --ensure-warps >= 1")
    ensure.BLOCK_S, ensure.NUM_WARPS = a.ensure_block_s, a.ensure_warps  # read at each call
    ensure.PREFETCH = not a.no_ensure_prefetch
    ensure.FUSED_POST = not a.separate_post
    if a.attention_warps < 1 or a.attention_warps & (a.attention_warps - 1) or a.attention_stages < 1:
        raise SystemExit("--attention-warps must be a power of two and --attention-stages >= 1")
    paged_attention.WARPS, paged_attention.STAGES = a.attention_warps, a.attention_stages  # read at each call
    if a.attention_prefetch_tiles < 0 or a.attention_prefetch_tiles & (a.attention_prefetch_tiles - 1):
        raise SystemExit("--attention-prefetch-tiles must be 0 or a power of two")
    paged_attention.PREFETCH_TILES = a.attention_prefetch_tiles
    norm_rope.PROLOGUE_EARLY_TRIGGER = not a.no_prologue_early_trigger
    if a.attention_min_tiles < 0:
        raise SystemExit("--attention-min-tiles must be >= 0")
    if a.attention_min_tiles:
        paged_attention.min_split_tiles = lambda *_: a.attention_min_tiles  # looked up at each call
    if a.norm_gemv_stages < 1:
        raise SystemExit("--norm-gemv-stages must be >= 1")
    for flag in ("up_rows", "up_warps", "down_rows", "down_k", "up_k"):
        if getattr(a, flag) < 0 or getattr(a, flag) & (getattr(a, flag) - 1):
            raise SystemExit(f"--{flag.replace('_', '-')} must be a power of two (0: the engine's)")
    if a.gemv == "plain":
        ExpertCache.arrivals = lambda self, copy: None  # decode_experts then waits for the copy kernel as a whole
    if a.miss_copy == "sm":
        ExpertCache.start_copy_service = lambda self: None
    copy_service.BATCH_GROUP = a.copy_batch_group
    miss_copy.PROGRAMS_PER_SM = a.copy_programs_per_sm
    if a.no_pdl:
        pdl.use_pdl = lambda device: False  # launch_args looks it up at each launch
    if a.norm_gemv == "off":
        SelfAttention.fuses_norm = lambda *args: False
    elif a.norm_gemv != "auto":
        fuses_norm, use_pdl = SelfAttention.fuses_norm, pdl.use_pdl

        def forced(self, x, residual, norm):  # the engine's conditions, as on a GPU without PDL
            pdl.use_pdl = lambda device: False
            try:
                return fuses_norm(self, x, residual, norm)
            finally:
                pdl.use_pdl = use_pdl

        SelfAttention.fuses_norm = forced
        if a.norm_gemv == "ordinary":
            dense_gemv.norm_gemv = ordinary_launches(dense_gemv, dense_gemv.norm_gemv)
        if a.norm_gemv == "on-spacer":
            dense_gemv.norm_gemv = spaced(dense_gemv.norm_gemv)
    dense_gemv.STAGES = a.norm_gemv_stages  # norm_gemv reads it at each call; gemv's default was bound at import
    if a.smem_carveout is not None:
        if not 0 <= a.smem_carveout <= 100:
            raise SystemExit(f"--smem-carveout is a percentage, 0-100; got {a.smem_carveout}")
        from smem_carveout import install  # benchmarks/smem_carveout.py (this folder)

        install(a.smem_carveout)
    if min(a.up_stages, a.down_stages) < 0:
        raise SystemExit("--up-stages and --down-stages must be >= 1 (0: the engine's)")
    overrides = ("down_n", a.down_rows), ("down_k", a.down_k), ("up_k", a.up_k), ("up_stages", a.up_stages)
    overrides += ("up_n", a.up_rows), ("up_warps", a.up_warps)
    blocks = {k: v for k, v in (*overrides, ("down_stages", a.down_stages)) if v}
    if blocks:
        pick = moe_gemv.pick_blocks
        moe_gemv.pick_blocks = lambda h, i: dataclasses.replace(pick(h, i), **blocks)
    if a.down_spacer:
        moe_gemv.down_proj = spaced(moe_gemv.down_proj)
    if a.down_ordinary_launch:
        moe_gemv.down_proj = ordinary_launches(moe_gemv, moe_gemv.down_proj)
    if a.dense_config:
        dense_gemv.gemv = configured_gemv(dense_gemv.gemv, dict(map(parse_dense_config, a.dense_config)))
    if a.pin_core is not None:
        torch.empty(1, device="cuda")  # CUDA's threads start here, on every core
        os.sched_setaffinity(0, {a.pin_core})  # 0: the calling thread only
    args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    return edgemoe_main(["bench", *args])


if __name__ == "__main__":
    sys.exit(main())
