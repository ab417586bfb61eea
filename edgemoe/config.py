"""Configuration: one frozen dataclass per concern.

`ModelConfig` is normalised once from a Hugging Face `config.json` (by the family's `normalise`);
`EngineConfig` holds every engine knob and maps 1:1 onto CLI flags; `ExpertCacheConfig` (its `moe` field) the
expert-offload knobs, whose field names are the flags' names (`engine_config` splits flat keyword arguments).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

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
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hidden_act: str = "silu"  # the MLPs' and experts' gate activation, a key of `edgemoe.layers.mlp.ACTIVATIONS`
    rotary_dim: int | None = None  # partial rotary: the leading dims of each head that RoPE turns; None: all of them
    # Per layer (kv_heads, head_dim) where layers differ (Gemma-4's global layers); empty: all (num_kv_heads, head_dim)
    kv_shapes: tuple[tuple[int, int], ...] = ()
    # Per layer, the layer whose KV cache it reads (a KV-shared layer reads an earlier one's, writing none); empty:
    # each its own
    kv_sources: tuple[int, ...] = ()
    # Layers that hold no KV cache (a linear-attention layer keeps per-sequence state instead): the KV cache neither
    # counts nor binds them
    no_kv_layers: tuple[int, ...] = ()
    # The block format (an `EXPERT_DTYPES` name) a safetensors checkpoint stores its routed experts in, which the
    # loader keeps as they are (gpt-oss's MXFP4, converted by the family); None: floats
    expert_format: str | None = None
    # The last mtp_layers of the num_layers layers are a multi-token-prediction head's (`edgemoe.models.mtp`: built
    # only for `--speculative mtp`), which the decoder's layer loop skips; 0: none
    mtp_layers: int = 0
    # A family's own settings that only its file reads (a frozen dataclass there, e.g. `gemma4.Gemma4Settings`)
    family_config: Any = None

    def __post_init__(self) -> None:
        """What a config.json could get wrong that would otherwise fail deep in the model, mid-generation
        (`read_config` names the file)."""
        sizes = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        moe = ("num_experts", "top_k", "moe_intermediate_size") if any(self.moe_layers) else ()  # dense: may be 0
        for name in (*sizes, *moe, "max_position_embeddings"):
            if not _count(getattr(self, name)):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} is more than num_experts {self.num_experts}")
        if not (isinstance(self.mtp_layers, int) and 0 <= self.mtp_layers < self.num_layers):
            raise ValueError(f"mtp_layers must be an integer in 0..{self.num_layers - 1}, got {self.mtp_layers!r}")
        for _, kv_heads, _ in filter(None, self.kv_layers()):
            if self.num_heads % kv_heads:
                raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {kv_heads}")
        rot = self.rotary_dim
        if rot is not None and not (_count(rot) and rot <= self.head_dim and rot % 2 == 0):
            raise ValueError(f"rotary_dim must be an even integer in 2..head_dim {self.head_dim}, got {rot!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")

    def kv_layers(self) -> list[tuple[int, int, int] | None]:
        """Per layer: (the layer whose KV cache it reads, kv_heads, head_dim), or None for a layer without KV
        (`no_kv_layers`); a layer reading another's has that layer's shape, and a layer that is read from reads its
        own."""
        shapes = self.kv_shapes or ((self.num_kv_heads, self.head_dim),) * self.num_layers
        sources = self.kv_sources or tuple(range(self.num_layers))
        if len(shapes) != self.num_layers or len(sources) != self.num_layers:
            raise ValueError(f"kv_shapes and kv_sources need one entry per layer ({self.num_layers})")
        no_kv = set(self.no_kv_layers)
        if any(not 0 <= s <= i or sources[s] != s or (s in no_kv and i not in no_kv) for i, s in enumerate(sources)):
            raise ValueError(f"kv_sources {sources}: a layer reads its own KV cache or an earlier layer's own")
        return [None if i in self.no_kv_layers else (s, *shapes[s]) for i, s in enumerate(sources)]

    @property
    def decoder_layers(self) -> int:
        """The layers a forward runs: all but the multi-token-prediction head's."""
        return self.num_layers - self.mtp_layers

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


def ram_budget(text: str | int | float) -> int | float:
    """`--ram-budget`: bytes ('24GiB') or a fraction of the experts ('0.25', in (0, 1))."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = None
    if value is not None and 0 < value < 1:
        return value
    try:  # a plain number past 1 with a fraction ('1.5') is no fraction of the experts, nor whole bytes
        size = parse_size(text) if value is None or value.is_integer() else 0
    except EdgeMoEError:
        size = 0
    if size <= 0:
        raise EdgeMoEError(f"cannot read ram_budget {text!r}: a size with a unit (24GiB) or a fraction in (0, 1)")
    return size


def check_model_path(model: str | None) -> None:
    """The cheap check of a --model before anything loads (the engine checks the rest): it exists, and is a folder or
    a .gguf file."""
    if model is None:
        return
    path = Path(model).resolve()
    if not (path.is_dir() or path.suffix == ".gguf" and path.is_file()):
        raise EdgeMoEError(f"model path {model} does not exist, or is neither a folder nor a .gguf file")


MOE_STRATEGIES = ("resident", "offload")
MOE_POLICIES = ("lru", "scored")  # the expert cache's eviction policies (`edgemoe.offload.policies.POLICIES`)
EXPERT_DTYPES = ("auto", "q8_0", "q4_0", "mxfp4", "q4_1", "q5_0", "q5_1")
SPECULATIVE = ("off", "ngram", "mtp")  # edgemoe/engine/speculative.py, edgemoe/engine/mtp.py
PLE_BACKENDS = ("gpu", "host", "disk")  # edgemoe/layers/ple.py, ple_disk.py
PLE_SYNCS = ("host", "wait")  # edgemoe/layers/ple_wait.py
TOOL_PARSERS = ("auto", "none", "qwen", "qwen3_coder", "mistral", "glm", "harmony")  # server/tool_calls.py, harmony.py
REASONING_PARSERS = ("auto", "none", "qwen3")  # edgemoe/server/reasoning.py


def option(default, help: str, cli: bool = True, metavar: str | None = None, off: str | None = None):  # noqa: A002
    """A config field that is also a command-line flag (`--field-name`), its help and default written once here
    (`add_flags` derives the flags). `cli=False`: the Python API only. A bool that defaults to True is the flag
    `--no-field-name`: `off` is its help, what the flag turns off (`help` says what the field does)."""
    return field(default=default, metadata={"help": help, "cli": cli, "metavar": metavar, "off": off})


@dataclass(frozen=True)
class ExpertCacheConfig:
    """Where routed experts live. `offload`: host banks plus a device cache of slots, sized by exactly one of
    `moe_cache_slots`, `moe_cache_fraction` (of all experts) or `vram_budget` (what dense weights and KV leave)."""

    moe_strategy: str = option("resident", f"where routed experts live: {' or '.join(MOE_STRATEGIES)}")
    moe_cache_slots: int | None = option(None, "offload: experts the device cache holds")
    moe_cache_fraction: float | None = option(None, "offload: cache this fraction of all experts")
    vram_budget: str | int | None = option(
        None, "device memory for weights, KV and expert cache, e.g. 16GiB (offload: sizes the cache)"
    )
    moe_policy: str = option("lru", "offload: eviction policy, lru or scored")
    ram_budget: str | None = option(
        None,
        "offload: host memory for routed experts, e.g. 24GiB, or a fraction of them, e.g. 0.25; the rest are read "
        "from disk: in place from a GGUF that holds them as stored, else from an expert store written once (default: "
        "every expert in RAM)",
    )
    expert_store: str | None = option(
        None,
        "with ram_budget: the folder of the expert store, written even where a GGUF could be read in place (default: "
        "beside the checkpoint, else ~/.cache/edgemoe/experts)",
        metavar="DIR",
    )
    expert_dtype: str = option(
        "auto",
        f"routed experts' storage: auto (as the checkpoint's) or {', '.join(EXPERT_DTYPES[1:])}: a safetensors "
        "checkpoint's experts quantized once at load, as the gguf package quantizes",
    )
    moe_collect_stats: bool = option(False, "offload: count accesses, hits, misses, evictions, bytes per layer")
    moe_cpu_compute: str | int = option(
        "auto",
        "offload: compute some missed experts of each decode step on the CPU beside the copy of the others: auto "
        "(CUDA: measured at start-up, kept only where it beats copying every miss; off on the CPU device), off, or N "
        "(at most N misses a layer-step on the CPU, for experiments)",
    )
    moe_cpu_threads: int | None = option(
        None, "offload with moe_cpu_compute: threads of the CPU expert pool (default: the physical cores)"
    )
    record_routing: str | None = option(
        None, "save one sequence's routed expert ids of each decode step (.npy) for `edgemoe cache-sim`", metavar="FILE"
    )

    def __post_init__(self) -> None:
        if self.moe_strategy not in MOE_STRATEGIES:
            raise EdgeMoEError(f"unknown moe_strategy {self.moe_strategy!r}: use resident or offload")
        if self.expert_dtype not in EXPERT_DTYPES:
            raise EdgeMoEError(f"unknown expert_dtype {self.expert_dtype!r}: use {', '.join(EXPERT_DTYPES)}")
        if self.moe_policy not in MOE_POLICIES:
            raise EdgeMoEError(f"unknown moe_policy {self.moe_policy!r}: use {' or '.join(MOE_POLICIES)}")
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
        if self.ram_budget is not None:
            if self.moe_strategy != "offload":
                raise EdgeMoEError("ram_budget keeps some experts on disk: it needs moe_strategy offload")
            ram_budget(self.ram_budget)
        if self.expert_store is not None and self.ram_budget is None:
            raise EdgeMoEError("expert_store is where experts beyond ram_budget go: give ram_budget too")
        cpu_compute = str(self.moe_cpu_compute)
        if self.ram_budget is not None and cpu_compute not in ("off", "auto"):
            raise EdgeMoEError("moe_cpu_compute computes misses from experts in RAM; with ram_budget use off")
        if cpu_compute not in ("off", "auto") and not (cpu_compute.isdigit() and cpu_compute.isascii()):
            raise EdgeMoEError(f"moe_cpu_compute must be off, auto or a number of misses >= 0, got {cpu_compute!r}")
        if cpu_compute not in ("off", "auto") and self.moe_strategy != "offload":
            raise EdgeMoEError("moe_cpu_compute computes missed experts: it needs moe_strategy offload")
        threads = self.moe_cpu_threads
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise EdgeMoEError(f"moe_cpu_threads must be an integer >= 1, got {self.moe_cpu_threads!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. Defaults suit one consumer GPU or a laptop CPU."""

    model: str | None = option(
        None, "Hugging Face model folder, or a GGUF file (or any part of a split set) (default: the bundled demo model)"
    )
    device: str = option("cpu", "cpu or cuda")
    dtype: str = option("auto", "auto, float32, bfloat16 or float16")
    max_model_len: int | None = option(None, "context limit in tokens (default: the model's)")
    max_num_seqs: int = option(8, "sequences decoded together")
    max_num_batched_tokens: int | None = option(
        None,
        "prompt tokens per prefill step (longer prompts are chunked); default: 512 with resident experts; offloaded, "
        "the largest power of two up to 16384 whose activations take at most an eighth of the device memory left "
        "(each chunk streams every expert once, whatever its length)",
    )
    kv_cache_memory: str | int = option(
        "auto",
        "KV cache size, e.g. 2GiB; auto: room for max_num_seqs sequences of max_model_len tokens, within 80 percent "
        "of the free GPU memory (1 GiB on the CPU)",
    )
    kv_cache_tokens: int | None = option(None, "KV cache size in tokens (rounded up to whole blocks), instead")
    block_size: int = option(16, "tokens per KV block")
    prefix_cache: bool = option(
        True,
        "reuse the KV cache of the longest cached whole-block prefix of a prompt (agent loops, shared system prompts)",
        off="turn off the prefix cache: compute every prompt whole, even a prefix an earlier request computed (greedy "
        "output is the same)",
    )
    batch_invariant: bool = option(
        False,
        "prefill one sequence a step, so that a sequence's KV and logits do not depend on the requests beside it "
        "(decode is batch-invariant always); costs prefill throughput when many prompts arrive together",
    )
    speculative: str = option(
        "off",
        "speculative decoding: off; ngram (prompt lookup: a greedy sequence whose last tokens occurred earlier in "
        "it drafts what followed them); or mtp (the checkpoint's multi-token-prediction head drafts: Qwen3-Next, "
        "Qwen3.5/3.6 MoE, GLM-4.5). One step verifies the drafts; the output is unchanged",
    )
    speculative_tokens: int = option(4, "speculative: tokens drafted a step at most")
    speculative_ngram: int = option(3, "speculative ngram: the longest tail matched (down to one token)")
    tensor_parallel: int = option(
        1,
        "processes the model is split over, one a GPU on CUDA (attention heads and every expert's intermediate axis "
        "split, quantized experts in whole blocks; safetensors or GGUF, resident or offloaded; every family but "
        "gemma4 so far)",
    )
    seed: int | None = option(
        None, "seed of the seeds of requests that give none (None: a fresh one per engine)", cli=False
    )
    progress: bool = option(True, "progress bar while loading weights", cli=False)
    cuda_graphs: bool = option(
        True,
        "CUDA: decode by replaying one captured graph per batch size (off: eagerly)",
        off="turn off CUDA graphs: decode eagerly, launching each kernel from Python (slower; the output is the same)",
    )
    warmup: bool = option(
        True,
        "CUDA: at start-up, prefill dummy prompts of a few lengths (kernels compiled, libraries loaded, memory grown), "
        "so that the first request runs as fast as later ones (off: a faster start-up, a slower first request)",
        off="turn off the start-up warm-up (CUDA): a faster start-up, a slower first request",
    )
    shared_expert_overlap: bool = option(
        True,
        "CUDA: the shared expert on a side stream beside the routed experts and their miss copy (off: inline)",
        cli=False,  # settled: the side stream is 2.6-3.1 % faster (RESULTS.md); `edgemoe bench` still weighs both
    )
    ple_backend: str = option(
        "gpu",
        "where per-layer embeddings (Gemma-4) live: gpu (in VRAM), host (in pinned RAM; the GPU gathers each step's "
        "rows), disk (a memory-mapped file: the checkpoint's tensor in place, else a copy in the run's dtype written "
        "beside it once; each step's rows read into a pinned staging buffer)",
    )
    ple_sync: str = option(
        "host",
        "ple_backend disk: host (read a step's rows, then launch it) or wait (launch the replayed step first; it "
        "waits on the GPU for the rows just before their first use; needs CUDA stream memory operations, else host)",
    )
    moe: ExpertCacheConfig = field(default_factory=ExpertCacheConfig)

    def __post_init__(self) -> None:
        names = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "kv_cache_tokens")
        for name in (*names, "speculative_tokens", "speculative_ngram", "tensor_parallel"):
            value = getattr(self, name)
            optional = ("max_num_batched_tokens", "max_model_len", "kv_cache_tokens")
            if (value is not None or name not in optional) and not _count(value):
                raise EdgeMoEError(f"{name} must be an integer >= 1, got {value!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise EdgeMoEError(f"seed must be an integer or None, got {self.seed!r}")
        if self.kv_cache_memory != "auto":
            parse_size(self.kv_cache_memory)
            if self.kv_cache_tokens is not None:
                raise EdgeMoEError("give one of kv_cache_memory and kv_cache_tokens")
        if self.speculative not in SPECULATIVE:
            choices = " or ".join(SPECULATIVE)
            raise EdgeMoEError(f"unknown speculative {self.speculative!r}: use {choices}")
        if self.ple_backend not in PLE_BACKENDS:
            raise EdgeMoEError(f"unknown ple_backend {self.ple_backend!r}: use {', '.join(PLE_BACKENDS)}")
        if self.ple_sync not in PLE_SYNCS:
            raise EdgeMoEError(f"unknown ple_sync {self.ple_sync!r}: use {' or '.join(PLE_SYNCS)}")
        if self.ple_sync == "wait" and self.ple_backend != "disk":
            raise EdgeMoEError(
                f"ple_sync wait waits for rows read from disk: use it with ple_backend disk, not {self.ple_backend}"
            )


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def engine_config(**kwargs) -> EngineConfig:
    """EngineConfig from flat keyword arguments (`LLM(...)`, CLI flags): expert-cache fields go to `moe`."""
    moe_fields = ExpertCacheConfig.__dataclass_fields__
    moe = {k: kwargs.pop(k) for k in list(kwargs) if k in moe_fields}
    try:
        return EngineConfig(**kwargs, moe=ExpertCacheConfig(**moe))
    except TypeError as exc:
        raise EdgeMoEError(f"unknown LLM option: {exc}") from None


@dataclass(frozen=True)
class ServeConfig:
    """`edgemoe serve`'s own knobs (the engine's are an `EngineConfig`)."""

    host: str = option("127.0.0.1", "address to listen on (this machine only by default)")
    port: int = option(8000, "TCP port; 0 picks a free one")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on every route but /health")
    max_queue: int = option(64, "sequences that may wait for a slot; beyond that requests get 429")
    max_body_bytes: int = option(4 << 20, "largest request body; larger ones get 413")
    default_max_tokens: int | None = option(
        None, "most tokens a request that gives no max_tokens may generate (default: up to the end of the context)"
    )
    tool_parser: str = option(
        "auto",
        f"tool-call format of the model's output: {', '.join(TOOL_PARSERS)} (auto: from the chat template and "
        "vocabulary)",
    )
    reasoning_parser: str = option(
        "auto", f"reasoning split from answers: {', '.join(REASONING_PARSERS)} (qwen3: <think>...</think>)"
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise EdgeMoEError(f"--port must be in 0..65535, got {self.port}")
        if self.max_queue < 0:
            raise EdgeMoEError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1:
            raise EdgeMoEError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise EdgeMoEError(f"--default-max-tokens must be >= 1, got {self.default_max_tokens}")
        if self.api_key is not None and not self.api_key.strip():
            raise EdgeMoEError("--api-key must not be empty")
        if self.tool_parser not in TOOL_PARSERS:
            raise EdgeMoEError(f"unknown --tool-parser {self.tool_parser!r}: use {', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise EdgeMoEError(
                f"unknown --reasoning-parser {self.reasoning_parser!r}: use {', '.join(REASONING_PARSERS)}"
            )


def cli_fields(cls: type) -> list:
    """The fields of a config dataclass that are command-line flags."""
    return [f for f in fields(cls) if f.metadata.get("cli")]


_TYPES = {"int": int, "float": float, "str": str}


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, defaults: dict[str, Any] | None = None
) -> None:
    """One flag per `option` field of `cls`: `--name` (a bool that defaults to True: `--no-name`, helped by what it
    turns off), typed from the field's annotation, its default and help from the field. `defaults`: a command's own
    defaults of some fields (`edgemoe generate` runs one sequence), help included."""
    for f in cli_fields(cls):
        flag, help_text = f"--{f.name.replace('_', '-')}", f.metadata["help"]
        default = (defaults or {}).get(f.name, f.default)
        if f.type == "bool":
            if f.default:
                if not f.metadata["off"]:
                    raise TypeError(f"{cls.__name__}.{f.name}: a flag --no-{flag[2:]} needs the help of option(off=)")
                parser.add_argument(f"--no-{flag[2:]}", dest=f.name, action="store_false", help=f.metadata["off"])
            else:
                parser.add_argument(flag, dest=f.name, action="store_true", help=help_text)
            continue
        kind = _TYPES[f.type.split(" | ")[0]]  # "str | int" sizes are read as text (parse_size)
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(
            flag, dest=f.name, type=kind, default=default, metavar=f.metadata["metavar"], help=help_text + shown
        )


def flag_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values of `cls`'s flags in parsed `args`, by field name."""
    return {f.name: getattr(args, f.name) for f in cli_fields(cls)}
