"""Tensor parallelism across processes (`--tensor-parallel N`): one process a rank, `torch.distributed` between them
(NCCL on CUDA, one GPU a rank; gloo on the CPU).

Rank 0 is the caller's engine: it schedules, samples and answers; ranks 1..N-1 are worker processes it spawns, each
holding a shard of the model and the same KV block count. Before every forward, rank 0 sends the step's host inputs
(`ModelRunner.prepare`), and every rank runs the forward on its shard: attention heads and KV heads split into N
contiguous groups, every dense MLP and every routed and shared expert split along its intermediate axis, each rank
computing its share of every projection back to the hidden size (`RowParallel`, `Reduced`: one all-reduce after
attention and one after the MLP or MoE block of each layer). The router, norms, embedding and lm_head are whole on
every rank, so every rank routes alike and holds the same hidden states.

Built so far: resident float experts (safetensors checkpoints) of the families with plain attention; steps run
eager (no CUDA graphs are captured). Refused in one line before anything is spawned: offloaded or quantized experts,
GGUF files, speculative decoding, the hybrid, gpt-oss, OLMoE and Gemma-4 attention, shapes that do not split evenly.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing
import os
import socket
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from edgemoe.config import EngineConfig, ModelConfig
from edgemoe.errors import EdgeMoEError
from edgemoe.layers.attention import Attention
from edgemoe.layers.linear import DecodeLinear
from edgemoe.layers.mlp import GatedMLP
from edgemoe.moe.experts import Experts
from edgemoe.moe.layer import SparseMoE

if TYPE_CHECKING:
    from edgemoe.engine.model_runner import ModelRunner

FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe")  # plain `Attention`, float experts
TIMEOUT = datetime.timedelta(minutes=10)  # a collective that waits longer: a rank is gone


def check(config: EngineConfig, cfg: ModelConfig, world: int) -> None:
    """One line for what tensor parallelism does not take yet (module docstring), before anything is spawned."""
    what = f"tensor_parallel {world}"
    if config.moe.moe_strategy != "resident":
        raise EdgeMoEError(f"{what}: offloaded experts are not split yet (moe_strategy resident)")
    if config.speculative != "off":
        raise EdgeMoEError(f"{what}: speculative decoding is not split yet")
    if config.moe.expert_dtype != "auto":
        raise EdgeMoEError(f"{what}: quantized experts are not split yet")
    if cfg.model_type not in FAMILIES:
        raise EdgeMoEError(f"{what}: {cfg.model_type} is not split yet (split: {', '.join(FAMILIES)})")
    if config.device == "cuda" and torch.cuda.device_count() < world:
        raise EdgeMoEError(f"{what}: {torch.cuda.device_count()} CUDA devices, one a rank needed")
    shapes = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
    if any(cfg.moe_layers):
        shapes["moe_intermediate_size"] = cfg.moe_intermediate_size
    if not all(cfg.moe_layers):
        shapes["intermediate_size"] = cfg.intermediate_size
    if cfg.shared_expert_intermediate_size:
        shapes["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    for name, n in shapes.items():
        if n % world:
            raise EdgeMoEError(f"{what}: {name} {n} does not split into {world} equal parts")


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """A rank's view of the model for its KV cache: its share of the heads."""
    return replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world)


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


class Reduced(RowParallel):
    """A layer's MLP or MoE block whose every projection back to the hidden size is split (`RowParallel`'s sum, once
    for the block); never fused with the next norm."""

    def fuses_norm(self, *args: object) -> bool:
        return False


def shard_model(model: nn.Module, rank: int, world: int) -> None:
    """Cut the loaded model down to rank `rank`'s shard, in place (module docstring)."""
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, rank, world)
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            _shard_experts(mlp.experts, rank, world)
            if mlp.shared_expert is not None:
                _shard_mlp(mlp.shared_expert, rank, world)
        else:
            _shard_mlp(mlp, rank, world)
        layer.mlp = Reduced(mlp)


def _part(n: int, rank: int, world: int) -> slice:
    size = n // world
    return slice(rank * size, (rank + 1) * size)


def _set(module: nn.Module, name: str, value: torch.Tensor | None) -> None:
    if value is not None:
        setattr(module, name, nn.Parameter(value.contiguous(), requires_grad=False))


def _shard_attention(attn: nn.Module, rank: int, world: int) -> None:
    if type(attn) is not Attention:
        raise EdgeMoEError(f"tensor_parallel: {type(attn).__name__} is not split yet")
    d, (q, k, _) = attn.d, attn.qkv_sizes
    heads, kv_heads = _part(attn.nq, rank, world), _part(attn.nkv, rank, world)
    rows = torch.arange(q + 2 * k).split([q, k, k])
    keep = torch.cat([rows[0].view(attn.nq, d)[heads], *(r.view(attn.nkv, d)[kv_heads] for r in rows[1:])]).flatten()
    proj = attn.qkv_proj
    _set(proj, "weight", proj.weight[keep])
    _set(proj, "bias", None if proj.bias is None else proj.bias[keep])
    proj.out_features = keep.numel()
    attn.nq, attn.nkv = attn.nq // world, attn.nkv // world
    attn.qkv_sizes = [attn.nq * d, attn.nkv * d, attn.nkv * d]
    attn.attn.num_heads, attn.attn.num_kv_heads = attn.nq, attn.nkv
    attn.o_proj = RowParallel(_columns(attn.o_proj, slice(heads.start * d, heads.stop * d), rank))


def _columns(linear: DecodeLinear, cols: slice, rank: int) -> DecodeLinear:
    """`linear` keeping input features `cols` (its bias on rank 0 alone)."""
    _set(linear, "weight", linear.weight[:, cols])
    if linear.bias is not None and rank:
        _set(linear, "bias", torch.zeros_like(linear.bias))
    linear.in_features = cols.stop - cols.start
    return linear


def _shard_mlp(mlp: nn.Module, rank: int, world: int) -> None:
    if type(mlp) is not GatedMLP:
        raise EdgeMoEError(f"tensor_parallel: {type(mlp).__name__} is not split yet")
    part = _part(mlp.gate_proj.out_features, rank, world)
    for proj in (mlp.gate_proj, mlp.up_proj):
        _set(proj, "weight", proj.weight[part])
        proj.out_features = part.stop - part.start
    _columns(mlp.down_proj, part, rank)


def _shard_experts(experts: nn.Module, rank: int, world: int) -> None:
    if type(experts) is not Experts or experts.gate_up_proj_bias is not None:
        raise EdgeMoEError(f"tensor_parallel: {type(experts).__name__} experts are not split yet")
    inter = experts.down_proj.shape[2]
    part = _part(inter, rank, world)
    up = slice(inter + part.start, inter + part.stop)
    gate_up = experts.gate_up_proj
    _set(experts, "gate_up_proj", torch.cat([gate_up[:, part], gate_up[:, up]], dim=1))  # [E, 2I/N, H]
    _set(experts, "down_proj", experts.down_proj[:, :, part])  # [E, H, I/N]


class TensorParallel:
    """This process's place among the ranks, and rank 0's side of the step protocol."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.workers: list[multiprocessing.Process] = []

    @classmethod
    def start(cls, config: EngineConfig) -> TensorParallel:
        """Rank 0: spawn ranks 1..N-1 (each builds the engine of `config` as its rank) and join them in one group."""
        world = config.tensor_parallel
        with socket.socket() as s:  # a free port for the group's rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        context = multiprocessing.get_context("spawn")
        self = cls(0, world)
        for rank in range(1, world):
            proc = context.Process(target=_worker, args=(config, rank, port), daemon=True)
            proc.start()
            self.workers.append(proc)
        _join(config, 0, port)
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
            dist.destroy_process_group()
            for proc in self.workers:
                proc.join(timeout=30)
            self.workers = []

    def serve(self, runner: ModelRunner) -> None:
        """Ranks 1..N-1: run each forward rank 0 sends, until it says stop."""
        while True:
            kind, step = self.common(None)
            if kind == "stop":
                dist.destroy_process_group()
                return
            runner.run_sent(step)


def _join(config: EngineConfig, rank: int, port: int) -> None:
    backend = "nccl" if config.device == "cuda" else "gloo"
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=config.tensor_parallel,
            timeout=TIMEOUT,
        )  # fmt: skip
    except RuntimeError as exc:
        raise EdgeMoEError(f"tensor_parallel: rank {rank} could not join the others: {exc}") from None


def _worker(config: EngineConfig, rank: int, port: int) -> None:
    """A rank's process: its engine (quiet), then the forwards rank 0 sends."""
    from edgemoe.engine.engine import LLMEngine

    stderr = sys.stderr
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - rank 0 speaks for all; errors below go to the real stderr
    try:
        _join(config, rank, port)
        parallel = TensorParallel(rank, config.tensor_parallel)
        engine = LLMEngine(replace(config, progress=False), parallel=parallel)
        parallel.serve(engine.runner)
    except Exception as exc:  # noqa: BLE001 - one line for whatever stopped this rank
        print(f"edgemoe: tensor_parallel rank {rank} stopped: {exc}", file=stderr, flush=True)
        os._exit(1)
