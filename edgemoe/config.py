"""Configuration: one frozen dataclass per concern.

`ModelConfig` is normalised once from a Hugging Face `config.json` (by the family's `normalise`);
`EngineConfig` holds every engine knob and maps 1:1 onto CLI flags; `ExpertCacheConfig` (its `moe` field) the
expert-offload knobs, whose field names are the flags' names (`engine_config` splits flat keyword arguments).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from edgemoe.errors import EdgeMoEError


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    moe_layers: tuple[bool, ...]  # per layer: routed experts (True) or a dense MLP (False)
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    qkv_bias: bool = False
    o_proj_bias: bool = False
    clip_qkv: float | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
}


def parse_size(text: str | int) -> int:
    """'16GiB', '512MB', '2048' -> bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise EdgeMoEError(f"cannot read size {text!r}: use a number with a unit, e.g. 16GiB or 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


MOE_STRATEGIES = ("resident", "offload")
GRAPH_UPLOADS = ("auto", "capture", "none")


@dataclass(frozen=True)
class ExpertCacheConfig:
    """Where routed experts live. `offload`: host banks plus a device cache of slots, sized by exactly one of
    `moe_cache_slots`, `moe_cache_fraction` (of all experts) or `vram_budget` (what dense weights and KV leave)."""

    moe_strategy: str = "resident"  # "resident" | "offload"
    moe_cache_slots: int | None = None
    moe_cache_fraction: float | None = None
    vram_budget: str | int | None = None  # e.g. "16GiB"; resident: checked, offload: sizes the cache
    moe_policy: str = "lru"  # eviction policy: "lru" | "scored"
    moe_collect_stats: bool = False  # per-layer accesses/hits/misses/evictions/bytes, counted on the device
    record_routing: str | None = None  # .npy path: routed expert ids of one sequence's decode

    def __post_init__(self) -> None:
        from edgemoe.offload.policies import POLICIES

        if self.moe_strategy not in MOE_STRATEGIES:
            raise EdgeMoEError(f"unknown moe_strategy {self.moe_strategy!r}: use resident or offload")
        if self.moe_policy not in POLICIES:
            raise EdgeMoEError(f"unknown moe_policy {self.moe_policy!r}: use {' or '.join(POLICIES)}")
        sizes = [n for n in ("moe_cache_slots", "moe_cache_fraction", "vram_budget") if getattr(self, n) is not None]
        if len(sizes) > 1:
            raise EdgeMoEError(f"give one of moe_cache_slots, moe_cache_fraction, vram_budget (got {', '.join(sizes)})")
        if self.moe_strategy == "resident" and (
            self.moe_cache_slots is not None or self.moe_cache_fraction is not None or self.moe_collect_stats
        ):
            raise EdgeMoEError("moe_cache_slots, moe_cache_fraction and moe_collect_stats need moe_strategy offload")
        if self.moe_cache_slots is not None and (not isinstance(self.moe_cache_slots, int) or self.moe_cache_slots < 1):
            raise EdgeMoEError(f"moe_cache_slots must be an integer >= 1, got {self.moe_cache_slots!r}")
        if self.moe_cache_fraction is not None and not 0 < self.moe_cache_fraction <= 1:
            raise EdgeMoEError(f"moe_cache_fraction must be in (0, 1], got {self.moe_cache_fraction!r}")
        if self.vram_budget is not None:
            parse_size(self.vram_budget)


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. Defaults suit one consumer GPU or a laptop CPU."""

    model: str | None = None  # None: the bundled demo model
    device: str = "cpu"
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 8  # sequences decoded together
    max_num_batched_tokens: int = 512  # tokens per prefill step (longer prompts are chunked)
    kv_cache_memory: str | int = "auto"  # bytes for the paged KV cache; "auto" sizes it from the device
    block_size: int = 16  # tokens per KV block
    seed: int = 0  # for requests that give no seed
    progress: bool = True  # progress bar while loading weights
    cuda_graphs: bool = True  # CUDA: capture decode in one graph per batch size (1, 2, 4, ..., max_num_seqs)
    graph_upload: str = "auto"  # "auto" | "capture" | "none": when captured graphs are uploaded (engine/cuda_graphs)
    graph_warm_replay: bool = False  # replay each graph once at capture time
    shared_expert_overlap: bool = True  # CUDA: shared expert on a side stream beside the routed experts (and copy)
    moe: ExpertCacheConfig = field(default_factory=ExpertCacheConfig)

    def __post_init__(self) -> None:
        if self.graph_upload not in GRAPH_UPLOADS:
            raise EdgeMoEError(f"unknown graph_upload {self.graph_upload!r}: use {', '.join(GRAPH_UPLOADS)}")


def engine_config(**kwargs) -> EngineConfig:
    """EngineConfig from flat keyword arguments (`LLM(...)`, CLI flags): expert-cache fields go to `moe`."""
    moe_fields = ExpertCacheConfig.__dataclass_fields__
    moe = {k: kwargs.pop(k) for k in list(kwargs) if k in moe_fields}
    try:
        return EngineConfig(**kwargs, moe=ExpertCacheConfig(**moe))
    except TypeError as exc:
        raise EdgeMoEError(f"unknown LLM option: {exc}") from None
