"""Paged KV cache: fixed-size blocks from one preallocated pool, handed to sequences as they grow.

A sequence holds only the blocks its tokens need, so a long context limit costs nothing up front.
Layout per layer: `[slots, kv_heads, head_dim]` with slot = block * block_size + offset. One extra
block at the end absorbs writes from padded (dummy) tokens. Layers may differ in shape, and a KV-shared layer
(`ModelConfig.kv_layers`) has no cache of its own: it is bound to the one it reads.

Prefix cache: a full block whose K/V are computed is known by a hash of its tokens and of every block before it
(`commit`), and a new sequence reuses the longest run of known blocks that starts its prompt (`match`), shared with
reference counts. A block nobody holds keeps its contents and stays findable until the pool needs it: plain free
blocks go first, then the least recently released known ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from edgemoe.config import EngineConfig, ModelConfig, parse_size
from edgemoe.errors import EdgeMoEError

GPU_SHARE, CPU_BYTES = 0.8, 1 << 30  # what an automatic KV cache may take at most: of the free GPU memory; on the CPU


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block in every layer that holds its own (not those reading another's, nor those without)."""
    own = sum(kv[1] * kv[2] for i, kv in enumerate(cfg.kv_layers()) if kv is not None and kv[0] == i)
    return 2 * block_size * own * dtype.itemsize


def kv_blocks(
    config: EngineConfig, per_block: int, max_model_len: int, device: torch.device, room: int | None = None
) -> tuple[int, str]:
    """How many KV blocks to allocate, and why that many (the engine says it in one line). `kv_cache_memory` or
    `kv_cache_tokens` when given, else room for `max_num_seqs` sequences of `max_model_len` tokens, within `room`
    (the share of a VRAM budget), GPU_SHARE of the free GPU memory, or CPU_BYTES. Never more blocks than
    max_num_seqs x max_model_len can use."""
    bs, seqs = config.block_size, config.max_num_seqs
    full = seqs * -(-max_model_len // bs)
    if config.kv_cache_memory != "auto":
        blocks = parse_size(config.kv_cache_memory) // per_block
        if blocks < 1:
            raise EdgeMoEError(
                f"kv_cache_memory {config.kv_cache_memory} holds no KV block; the minimum is {per_block} bytes"
            )
        return blocks, f"kv_cache_memory {config.kv_cache_memory}"
    if config.kv_cache_tokens is not None:
        blocks = -(-config.kv_cache_tokens // bs)
        if blocks > full:
            return full, f"kv_cache_tokens {config.kv_cache_tokens}, capped at max_num_seqs x max_model_len"
        return blocks, f"kv_cache_tokens {config.kv_cache_tokens}"
    if room is not None:
        cap, where = room, "the share of vram_budget it may take"
    elif device.type == "cuda":
        cap, where = int(torch.cuda.mem_get_info(device)[0] * GPU_SHARE), f"{GPU_SHARE:.0%} of the free GPU memory"
    else:
        cap, where = CPU_BYTES, f"{CPU_BYTES >> 30} GiB on the CPU"
    why = f"max_num_seqs {seqs} x max_model_len {max_model_len}"
    if full * per_block <= cap:
        return full, why
    return max(1, cap // per_block), f"{why} would take {full * per_block / 2**30:.1f} GiB; capped at {where}"


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        prefix_cache: bool = False,
    ) -> None:
        self.num_blocks, self.block_size, self.prefix_cache = num_blocks, block_size, prefix_cache
        rows = (num_blocks + 1) * block_size
        layers = [kv for kv in cfg.kv_layers() if kv is not None]  # the layers that attend, in order
        own = {s: (h, d) for s, h, d in layers}  # each source layer once
        total = sum(rows * h * d for h, d in own.values())
        self.k = torch.zeros(total, dtype=dtype, device=device)  # every layer's own cache, one after another
        self.v = torch.zeros(total, dtype=dtype, device=device)
        views, start = {}, 0
        for s, (h, d) in sorted(own.items()):
            n = rows * h * d
            views[s] = (self.k[start : start + n].view(rows, h, d), self.v[start : start + n].view(rows, h, d))
            start += n
        self.layers = [views[s] for s, _, _ in layers]  # per attending layer: (k, v) [slots, kv_heads, head_dim]
        self.pad_block = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives low ids first
        self.refs = [0] * num_blocks  # sequences holding each block
        self.key: list[tuple | None] = [None] * num_blocks  # a committed block's (hash, tokens)
        self.known: dict[int, int] = {}  # hash -> block
        self.released: OrderedDict[int, None] = OrderedDict()  # known blocks nobody holds, least recent first
        self.queried_tokens = self.hit_tokens = 0  # prompt tokens looked up, and found, in the prefix cache
        self.evicted = 0  # known blocks given up to make room

    def bind(self, model: torch.nn.Module) -> None:
        """Give every paged-attention module of `model` (found by type, in order: one per layer that attends) its
        views of the pool and the block size; a layer that keeps other state binds to its own cache likewise."""
        from edgemoe.layers.attention import PagedAttention

        found = [m for m in model.modules() if isinstance(m, PagedAttention)]
        if len(found) != len(self.layers):
            raise ValueError(f"the model has {len(found)} paged-attention layers; the KV cache has {len(self.layers)}")
        for attn, (k, v) in zip(found, self.layers):
            attn.bind(k, v, self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.released)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError("KV cache exhausted (the scheduler should have checked)")
        out = []
        for _ in range(n):
            if self.free:
                block = self.free.pop()
            else:  # the least recently released known block gives up its contents
                block, _ = self.released.popitem(last=False)
                del self.known[self.key[block][0]]
                self.key[block] = None
                self.evicted += 1
            self.refs[block] = 1
            out.append(block)
        return out

    def release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if self.key[block] is None:
                    self.free.append(block)
                else:
                    self.released[block] = None
        blocks.clear()

    def match(self, tokens: list[int], resumable: Callable[[int], bool] | None = None) -> list[int]:
        """The known blocks that hold the longest whole-block prefix of `tokens` but its last token (a step must
        compute at least one), now held once more by the caller. Empty without the prefix cache. `resumable`: only
        a prefix whose last block's hash it accepts will do (a model whose layers keep a state resumes from a
        snapshot of it, `edgemoe.engine.state_cache`)."""
        if not self.prefix_cache:
            return []
        bs, parent, blocks = self.block_size, None, []
        for start in range(0, len(tokens) - 1 - bs + 1, bs):
            chunk = tuple(tokens[start : start + bs])
            block = self.known.get(hash((parent, chunk)))
            if block is None or self.key[block][1] != chunk or self.key[block][2] != parent:
                break
            parent = self.key[block][0]
            blocks.append(block)
        while resumable is not None and blocks and not resumable(self.key[blocks[-1]][0]):
            blocks.pop()
        for block in blocks:
            self.refs[block] += 1
            self.released.pop(block, None)
        self.queried_tokens += len(tokens)
        self.hit_tokens += len(blocks) * bs
        return blocks

    def commit(
        self, tokens: list[int], table: list[int], computed: int, hashed: int, parent: int | None
    ) -> tuple[int, int | None]:
        """Make the full blocks of `table` whose `computed` tokens' K/V are written findable by their prefix; the
        first `hashed` blocks were (`parent`: the last one's hash). -> (blocks hashed, the last one's hash). A block
        whose prefix another block already holds stays unknown, and the chain goes on through the hash."""
        if not self.prefix_cache:
            return hashed, parent
        bs = self.block_size
        for i in range(hashed, computed // bs):
            block, chunk = table[i], tuple(tokens[i * bs : (i + 1) * bs])
            h = hash((parent, chunk))
            if self.key[block] is None and h not in self.known:
                self.key[block] = (h, chunk, parent)
                self.known[h] = block
            parent = h
        return max(hashed, computed // bs), parent
