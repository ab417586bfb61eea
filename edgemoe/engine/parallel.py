"""Tensor parallelism across processes (`--tensor-parallel N`): one process a rank, `torch.distributed` between them
(NCCL on CUDA, one GPU a rank; gloo on the CPU).

Rank 0 is the caller's engine: it schedules, samples and answers; ranks 1..N-1 are worker processes it spawns. Each
rank builds the model of its share of the shapes (`shard_config`: its attention heads and KV heads, a contiguous
group of them, and its part of every dense MLP's and every routed and shared expert's intermediate axis), and the
loader hands it its share of each checkpoint tensor (`cut`): nothing is held whole, and offloaded experts need no
change (each rank's host banks, expert cache and copies hold its share of every expert). Before every forward, rank 0
sends the step's host inputs (`ModelRunner.prepare`) and every rank runs it, summing the ranks' shares where a layer
returns to the hidden size (`RowParallel`, `Reduced`: one all-reduce after attention, one after the MLP or MoE block).
The router, norms, embedding and lm_head are whole on every rank, so every rank holds the same hidden states and
routes alike, and with a deterministic cache policy its expert cache decides alike. The KV block count is rank 0's.

The routed experts' intermediate axis splits in whole blocks of their format where they are quantized (`Cut.unit`:
a GGUF's down rows, gpt-oss's MXFP4, or `expert_dtype`'s blocks), as evenly as whole blocks allow: qwen3-30b-a3b's 768
in Q4_K's 256-weight blocks go 512 + 256 to two ranks. Uneven shares give the ranks expert rows of different sizes, so
under a VRAM budget each would fit another number of slots: every rank takes the fewest (`TensorParallel.least`), so
that their caches decide alike and their misses come at the same steps (each step waits for the slowest rank).

Built so far: experts of safetensors checkpoints (float, gpt-oss's MXFP4 as stored, or quantized on load by each
rank) and of GGUF files (kept as stored, each rank its rows; dense weights dequantized), resident or offloaded, of the
families whose attention is `Attention` (gpt-oss's sinks split with its heads, its expert and o_proj biases added by
rank 0 alone; OLMoE's q/k norm over all heads from every rank's squares, `SplitRMSNorm`) and of the hybrids (a family
names its own shapes and the tensors laid out by head: `shard_config`, `split_segments`, `SPLIT_WITH_HEADS` in
`edgemoe.models.qwen3_next`; each rank keeps its heads' share of every sequence's state, and rank 0's changes to its
state rows go with the next step: `StateCache.journal`); steps run eager (no CUDA graphs are captured); prompt lookup's
verify steps are eager steps like any. Refused in one line before anything is spawned: a RAM budget, the CPU split
beside offloaded experts, MTP drafts, Gemma-4's attention, heads and dense intermediate sizes that do not split
evenly, expert rows of fewer blocks than ranks.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from edgemoe.config import EngineConfig, ModelConfig
from edgemoe.errors import EdgeMoEError
from edgemoe.layers.attention import Attention
from edgemoe.layers.norm import RMSNorm
from edgemoe.quant import QUANT_TYPES, quant_type

FAMILIES = (
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "glm4_moe",
    "gpt_oss",
    "olmoe",
    "qwen3_next",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
)  # `Attention` and its subclasses; the hybrids' Gated DeltaNet
TIMEOUT = datetime.timedelta(minutes=10)  # a collective that waits longer: a rank is gone


def check(config: EngineConfig, cfg: ModelConfig, world: int, unit: int = 1) -> None:
    """One line for what tensor parallelism does not take yet (module docstring), before anything is spawned. `unit`:
    the weights the routed experts' intermediate axis splits in (`expert_unit`)."""
    what, moe = f"tensor_parallel {world}", config.moe
    if moe.ram_budget is not None:
        raise EdgeMoEError(f"{what}: a RAM budget (the disk tier) is not split yet")
    if moe.moe_strategy == "offload" and config.device == "cuda" and str(moe.moe_cpu_compute) != "off":
        raise EdgeMoEError(
            f"{what}: offloaded experts need moe_cpu_compute off (each rank would measure its own split)"
        )
    if config.speculative == "mtp":
        raise EdgeMoEError(f"{what}: the MTP head is not split yet (speculative ngram is)")
    if cfg.model_type not in FAMILIES:
        raise EdgeMoEError(f"{what}: {cfg.model_type} is not split yet (split: {', '.join(FAMILIES)})")
    if config.device == "cuda" and torch.cuda.device_count() < world:
        raise EdgeMoEError(f"{what}: {torch.cuda.device_count()} CUDA devices, one a rank needed")
    if any(cfg.moe_layers) and cfg.moe_intermediate_size // unit < world:
        raise EdgeMoEError(
            f"{what}: moe_intermediate_size {cfg.moe_intermediate_size} is {cfg.moe_intermediate_size // unit} "
            f"blocks of {unit} weights, fewer than the ranks"
        )
    shapes = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
    if not all(cfg.moe_layers):
        shapes["intermediate_size"] = cfg.intermediate_size
    if cfg.shared_expert_intermediate_size:
        shapes["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    for name, n in shapes.items():
        if n % world:
            raise EdgeMoEError(f"{what}: {name} {n} does not split into {world} equal parts")


def expert_unit(config: EngineConfig, cfg: ModelConfig, gguf_blocks: int | None) -> int:
    """The weights the routed experts' intermediate axis splits in: a GGUF's down rows' blocks (`gguf_blocks`, the
    largest of its layers'), the blocks of a checkpoint's own format (gpt-oss's MXFP4) or of `expert_dtype` where the
    experts are quantized on load, else one."""
    if gguf_blocks is not None:
        return gguf_blocks
    stored = cfg.expert_format if cfg.expert_format in QUANT_TYPES else None
    kind = stored or (None if config.moe.expert_dtype == "auto" else config.moe.expert_dtype)
    return 1 if kind is None else quant_type(kind).block_weights


def stored_unit_bytes(cfg: ModelConfig, unit: int) -> int | None:
    """The bytes of `unit` weights of a down row where a safetensors checkpoint's experts come as blocks (gpt-oss's
    MXFP4, which the family repacks into rows of blocks), else None (floats: cut by weights)."""
    if cfg.expert_format not in QUANT_TYPES:
        return None
    q = quant_type(cfg.expert_format)
    return unit // q.block_weights * q.block_bytes


def shares(n: int, world: int, unit: int = 1) -> list[tuple[int, int]]:
    """`n` (a multiple of `unit`) split into `world` runs of whole units, as even as they go, the larger first: each
    rank's (start, size)."""
    units = n // unit
    sizes = [(units // world + (r < units % world)) * unit for r in range(world)]
    return [(sum(sizes[:r]), sizes[r]) for r in range(world)]


def shard_config(cfg: ModelConfig, world: int, rank: int = 0, unit: int = 1) -> ModelConfig:
    """A rank's model: its share of the heads and of every intermediate axis (the routed experts' in whole `unit`s)."""
    return replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=cfg.num_kv_heads // world,
        intermediate_size=cfg.intermediate_size // world,
        moe_intermediate_size=shares(cfg.moe_intermediate_size, world, unit)[rank][1],
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // world,
    )


_ROWS = re.compile(r"\.(self_attn\.[qkv]_proj\.(weight|bias)|(mlp|shared_expert)\.(gate|up)_proj\.weight)$")
_COLUMNS = re.compile(r"\.(self_attn\.o_proj|(mlp|shared_expert)\.down_proj)\.weight$")
_EXPERT_ROWS = re.compile(r"\.experts\.\d+\.(gate|up)_proj\.weight$")
_EXPERT_COLUMNS = re.compile(r"\.experts\.\d+\.down_proj\.weight$")


@dataclass(frozen=True)
class Cut:
    """A rank's share of each checkpoint tensor (the loader calls it with our name, once converted): q/k/v rows of its
    heads (heads are contiguous rows), gate/up rows and down columns of its part of every intermediate axis (dense
    MLPs and shared experts evenly; routed experts, per expert or stacked, in whole `unit`s: `shares`), o_proj
    columns of its heads; o_proj's bias on rank 0 alone (the ranks' outputs are summed). Anything else whole."""

    rank: int
    world: int
    unit: int = 1
    unit_bytes: int | None = None  # a stacked down_proj of blocks (gpt-oss's MXFP4): the bytes of a unit in its rows
    with_heads: tuple[str, ...] = ()  # the family's further tensors laid out by head (`SPLIT_WITH_HEADS`)
    columns_with_heads: tuple[str, ...] = ()  # ... and those whose columns are (`SPLIT_COLUMNS_WITH_HEADS`)
    segments: dict[str, list[int]] = field(default_factory=dict)  # by name's end: rows in runs, each split alike

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if _ROWS.search(name) or name.endswith((".self_attn.attn.sinks", *self.with_heads)):  # (sinks: one a head)
            return self._even(t, 0)
        if _COLUMNS.search(name) or name.endswith(self.columns_with_heads):
            return self._even(t, 1)
        runs = next((sizes for end, sizes in self.segments.items() if name.endswith(end)), None)
        if runs is not None:  # (the hybrids' in_proj_qkv and its convolution: the q, k and v heads' rows)
            return torch.cat([self._even(part, 0) for part in t.split(runs)])
        if name.endswith((".self_attn.o_proj.bias", ".experts.down_proj_bias")):  # added once, to the sum
            return t if self.rank == 0 else torch.zeros_like(t)
        if _EXPERT_ROWS.search(name):
            return self.experts(t, 0)
        if _EXPERT_COLUMNS.search(name):
            return self.experts(t, 1)
        if name.endswith((".experts.gate_up_proj", ".experts.gate_up_proj_bias")):  # [E, 2I, H], [E, 2I]: each half's
            gate, up = t.chunk(2, dim=1)
            return torch.cat([self.experts(gate, 1), self.experts(up, 1)], dim=1)
        if name.endswith((".experts.gate_proj_bias", ".experts.up_proj_bias")):  # a GGUF's [E, I]
            return self.experts(t, 1)
        if name.endswith(".experts.down_proj"):  # [E, H, I], or [E, H, row bytes] of blocks
            return self.experts(t, 2, self.unit_bytes if t.dtype == torch.uint8 else None)
        return t

    def _even(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        size = t.shape[dim] // self.world
        return t.narrow(dim, self.rank * size, size)

    def experts(self, t: torch.Tensor, dim: int, per_unit: int | None = None) -> torch.Tensor:
        """The rank's share of a routed expert tensor's intermediate axis `dim`, counted in weights, or where
        `per_unit` is given in stored elements, `per_unit` of them a unit (a GGUF row's bytes of one block)."""
        if per_unit is None:
            start, size = shares(t.shape[dim], self.world, self.unit)[self.rank]
        else:
            blocks = t.shape[dim] // per_unit
            start, size = (
                x // self.unit * per_unit for x in shares(blocks * self.unit, self.world, self.unit)[self.rank]
            )
        return t.narrow(dim, start, size)


class RowParallel(nn.Module):
    """A projection whose input features are split across ranks: each computes its share of every output, and their
    sum over the ranks (one all-reduce) is the whole product. Its bias stays on rank 0 alone."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        dist.all_reduce(out)
        return out


class SplitRMSNorm(nn.Module):
    """An RMSNorm over a dimension the ranks split (OLMoE's q/k norm spans every head, not one): the mean square over
    the whole dimension from each rank's sum of squares (one all-reduce), each rank scaling its share."""

    def __init__(self, inner: RMSNorm, world: int) -> None:
        super().__init__()
        self.weight, self.eps, self.dim = inner.weight, inner.eps, inner.weight.shape[0] * world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        squares = h.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares)
        return self.weight * (h * torch.rsqrt(squares / self.dim + self.eps)).to(x.dtype)


class Reduced(RowParallel):
    """A layer's MLP or MoE block whose every projection back to the hidden size is split (`RowParallel`'s sum, once
    for the block); never fused with the next norm."""

    def fuses_norm(self, *args: object) -> bool:
        return False


def shard_model(model: nn.Module) -> None:
    """Sum the ranks' shares where a layer returns to the hidden size: after attention's o_proj (`RowParallel`) and
    after its MLP or MoE block (`Reduced`). The model was built and loaded as this rank's share (`shard_config`,
    `cut`)."""
    world = dist.get_world_size()
    for layer in model.model.layers:
        attn = layer.self_attn
        if isinstance(attn, Attention):
            for name in ("q_norm", "k_norm"):  # a norm over all of its heads (OLMoE's), not each head's
                norm = getattr(attn, name)
                if norm is not None and norm.weight.shape[0] > attn.d:
                    setattr(attn, name, SplitRMSNorm(norm, world))
            attn.o_proj = RowParallel(attn.o_proj)
        elif getattr(attn, "splits_by_head", False):  # a token mixer whose out_proj reads its heads (Gated DeltaNet)
            attn.out_proj = RowParallel(attn.out_proj)
        else:
            raise EdgeMoEError(f"tensor_parallel: {type(attn).__name__} is not split yet")
        layer.mlp = Reduced(layer.mlp)


class TensorParallel:
    """This process's place among the ranks, and rank 0's side of the step protocol."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.workers: list[multiprocessing.Process] = []

    @classmethod
    def start(cls, config: EngineConfig, worker: Callable[[EngineConfig, int, int], None]) -> TensorParallel:
        """Rank 0: spawn ranks 1..N-1, each a process running `worker(config, rank, port)` (which builds the engine of
        `config` as its rank and serves), and join them in one group (`join`, at `port`)."""
        world = config.tensor_parallel
        with socket.socket() as s:  # a free port for the group's rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        context = multiprocessing.get_context("spawn")
        self = cls(0, world)
        for rank in range(1, world):
            proc = context.Process(target=worker, args=(config, rank, port), daemon=True)
            proc.start()
            self.workers.append(proc)
        join(config, 0, port)
        atexit.register(self.close)
        return self

    def device(self, device: torch.device) -> torch.device:
        """The rank's device: CUDA device `rank` on CUDA."""
        return torch.device("cuda", self.rank) if device.type == "cuda" else device

    def common(self, value: object) -> object:
        """Rank 0's `value` on every rank (each rank calls it at the same point)."""
        box = [value]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError as exc:  # (torch's DistBackendError is one)
            raise self.failure(exc) from None
        return box[0]

    def failure(self, exc: BaseException) -> EdgeMoEError:
        """A collective that failed -> one line naming the ranks whose process ended; the group is given up."""
        gone = [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.workers) if p.exitcode is not None]
        if dist.is_initialized():
            dist.destroy_process_group()
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        why = f"{', '.join(gone)} ended" if gone else first
        return EdgeMoEError(f"tensor_parallel: the ranks lost each other ({why}); start the engine again")

    def least(self, value: int) -> int:
        """The smallest of the ranks' `value`s, on every rank (each rank calls it at the same point)."""
        values = [None] * self.world
        try:
            dist.all_gather_object(values, value)
        except RuntimeError as exc:
            raise self.failure(exc) from None
        return min(values)

    def send(self, step: tuple) -> None:
        """Rank 0: a forward's inputs to the other ranks (`serve` runs it there)."""
        self.common(("step", step))

    def close(self) -> None:
        """Rank 0: the workers stop; the group ends."""
        if not dist.is_initialized():
            return
        try:
            self.common(("stop", None))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            for proc in self.workers:
                proc.join(timeout=30)
            self.workers = []

    def abort(self) -> None:
        """Rank 0, when its engine cannot start: the workers killed (they may wait in any collective), the group
        ended."""
        for proc in self.workers:
            proc.kill()
            proc.join(timeout=30)
        self.workers = []
        if dist.is_initialized():
            dist.destroy_process_group()

    def serve(self, run: Callable[[tuple], None]) -> None:
        """Ranks 1..N-1: `run` each forward rank 0 sends (`ModelRunner.run_sent`), until it says stop."""
        while True:
            kind, step = self.common(None)
            if kind == "stop":
                dist.destroy_process_group()
                return
            run(step)


def join(config: EngineConfig, rank: int, port: int) -> None:
    """This process into the group of `config.tensor_parallel` ranks whose rendezvous is `port`."""
    backend = "nccl" if config.device == "cuda" else "gloo"
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=config.tensor_parallel,
            timeout=TIMEOUT,
        )  # fmt: skip
    except RuntimeError as exc:
        raise EdgeMoEError(f"tensor_parallel: rank {rank} could not join the others: {exc}") from None


def follow_parent() -> None:
    """A worker ends when rank 0's process does, however that ended (a killed one runs no exit handler to stop it)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
