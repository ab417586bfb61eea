"""`ExpertCache.ensure` on CUDA as one Triton launch, instead of ~60 small torch kernels and a sort of every slot.

One program does the whole call, phase after phase, with a barrier wherever a phase reads what another thread of
the program wrote to global memory: every slot's eviction key (an int64 that orders like the float64 key, NaN first
as in torch.sort); which experts the ids name (marked in scratch with the new clock value, so the marks need no
clearing: older marks are smaller, and `ExpertCache.reset` zeroes them with the clock); hits, misses, the copy
list's experts and the CPU split's (the last `cpu_take[misses]` misses); only if something is copied, the `count`
largest keys among the slots this call does not hit; the mapping update; the policy's update; stats. The keys of a
pool of up to BLOCK_S slots stay in registers and the victims are taken from them one by one; larger pools keep their
keys in scratch and per-block maxima in registers.

Two things shorten the decode step's critical path, which runs router -> ensure -> copy -> experts when a layer
misses (docs/findings.md, "`ensure`"):
- Before its PDL wait, the kernel computes every slot's key and asks L2 for the layer's `slot_of` row (and
  `freq`, `last`) in bulk. Only earlier calls of this kernel write the clock and the cache state these read, not
  the router it waits for, and each of those calls had finished before the kernel just before this one started
  (each decode kernel lets the next start only after its own wait: `edgemoe.kernels.pdl`; host-side writes such
  as `reset` are torch kernels, which keep the full dependency; the expert GEMV behind an SM miss copy starts
  its successor early, but it started only once that copy, which waits for this kernel, had). So the pass over
  every slot overlaps the router, and after the wait each victim is one arg-max over keys already computed (in
  registers up to BLOCK_S slots, from scratch beyond): this call's hits are passed over as they come up instead
  of being ranked last first.
- In a step that hands its copies to the copy service (a captured step, given the banks by `ExpertCache.ensure`)
  the kernel posts the list to the service's mailbox itself as soon as the victims are chosen
  (`edgemoe.kernels.miss_copy.post_list`'s parts), so the host's copies start while the mapping, policy and stats
  updates still run, and no post kernel follows. The expert GEMV then waits for this kernel before it reads the
  slots (`Arrivals.after_ensure`). With the CPU split the same row carries the CPU's misses, the step's routed ids
  and its x (fp32, beside the mailbox): a list with CPU misses is posted even when nothing is copied, and the host
  computes them once the copies are queued (`edgemoe.kernels.protocol`).

`ExpertCache._ensure_torch` is its oracle: the returned tensors and every state tensor are bitwise identical
(tests/kernels run the kernel under Triton's interpreter, tests/gpu compiled). Float64 steps follow torch's order,
one rounding each: FMA contraction is off and inexact constants are built as float64. Imported only on CUDA
devices and in tests.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from edgemoe.kernels.miss_copy import claim_row, publish_row, write_cpu_list, write_list
from edgemoe.kernels.pdl import launch_args, prefetch_l2, use_pdl, wait_for_inputs
from edgemoe.kernels.protocol import HEADER, KEY_MAX, Ensured, PolicyState, PostTarget


class CacheState(Protocol):
    """What the kernel reads and writes of an `edgemoe.offload.expert_cache.ExpertCache`."""

    num_layers: int
    num_experts: int
    num_slots: int
    device: torch.device
    expert_bytes: int
    collect_stats: bool
    policy: object  # an eviction policy: its `kernel_state()` -> PolicyState
    slot_of: torch.Tensor
    owner: torch.Tensor
    clock: torch.Tensor
    stats: torch.Tensor
    ensure_scratch: torch.Tensor | None


# slots per step of the key pass and the victim search, and warps: a real pool's slots in one step over 8 warps
# (docs/findings.md, "Every slot's key before the wait"); smaller pools take one step of next_power_of_2(S)
BLOCK_S = 4096
BLOCK_N = 256  # ids per step
BLOCK_X = 1024  # elements of x per step of its post (the CPU split's)
NUM_WARPS = 8

_HEADER = tl.constexpr(HEADER)
_KEY_MAX = tl.constexpr(KEY_MAX)
_ORD_MAX = tl.constexpr(2**63 - 1)  # ordered NaN
_TAKEN = tl.constexpr(-(2**63))  # below every ordered key: a slot already chosen, or past S


@triton.jit
def _ordered(k):
    """float64 keys -> int64 of the same order: NaN above +inf (torch.sort's order), -0.0 equal to 0.0."""
    bits = k.to(tl.int64, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ _ORD_MAX)  # negative floats: larger magnitude, smaller int
    ordered = tl.where(k == 0.0, 0, ordered)
    return tl.where(k != k, _ORD_MAX, ordered)


@triton.jit
def _slot_keys(owner, last_use, freq, last, reuse, offs, now, layer, L: tl.constexpr, E: tl.constexpr,
               S: tl.constexpr, SCORED: tl.constexpr):  # fmt: skip
    """Ordered eviction keys of slots `offs` [BLOCK_S] (_TAKEN past S): the policy's `keys`, clamped, free slots
    first. This call's hits are not known yet: `_choose_victims` passes over them."""
    inside = offs < S
    own = tl.load(owner + offs, mask=inside, other=-1)  # [BLOCK_S]
    if SCORED:
        o = tl.maximum(own, 0)  # free slots: any value, ranked first below
        o_layer = o // E
        rho = tl.load(reuse + o_layer, mask=inside, other=0.0)
        p = rho * tl.load(last + o, mask=inside, other=0.0) + (1.0 - rho) * tl.load(freq + o, mask=inside, other=0.0)
        k = L * (1.0 / p - 1.0) + ((o_layer - layer - 1 + L) % L + 1).to(tl.float64)  # + L: no negative modulo
    else:
        k = (now - tl.load(last_use + offs, mask=inside, other=0)).to(tl.float64)
    key_max = tl.full([], _KEY_MAX, tl.float64)
    k = tl.where(k > key_max, key_max, k)  # torch's clamp: NaN stays NaN
    k = tl.where(own < 0, float("inf"), k)
    return tl.where(inside, _ordered(k), _TAKEN)


@triton.jit
def _fold(x, offs, b, blocks, best, best_at):
    """Set block b's entry of (best, best_at) to the largest of its keys `x` and that key's lowest slot."""
    top = tl.max(x, 0)
    at = tl.min(tl.where(x == top, offs, 2**31 - 1), 0)
    return tl.where(blocks == b, top, best), tl.where(blocks == b, at, best_at)


@triton.jit
def _key_pass(keys, owner, last_use, freq, last, reuse, now, layer, L: tl.constexpr, E: tl.constexpr,
              S: tl.constexpr, SCORED: tl.constexpr, BLOCK_S: tl.constexpr, NUM_BLOCKS: tl.constexpr,
              BLOCKS_P2: tl.constexpr):  # fmt: skip
    """Every slot's key, before the router's ids are known -> (x, best, best_at). One block (NUM_BLOCKS == 1): x
    holds all S keys, in registers. Several: the keys go to `keys`, and best / best_at [BLOCKS_P2] hold each
    block's largest key and its lowest slot."""
    blocks = tl.arange(0, BLOCKS_P2)
    best = tl.full([BLOCKS_P2], _TAKEN, tl.int64)
    best_at = tl.zeros([BLOCKS_P2], tl.int32)
    x = _slot_keys(owner, last_use, freq, last, reuse, tl.arange(0, BLOCK_S), now, layer, L, E, S, SCORED)
    if NUM_BLOCKS > 1:
        for b in range(NUM_BLOCKS):
            offs = b * BLOCK_S + tl.arange(0, BLOCK_S)
            if b > 0:
                x = _slot_keys(owner, last_use, freq, last, reuse, offs, now, layer, L, E, S, SCORED)
            tl.store(keys + offs, x, mask=offs < S)
            best, best_at = _fold(x, offs, b, blocks, best, best_at)
    return x, best, best_at


@triton.jit
def _choose_victims(x, best, best_at, keys, dst, count, row, hit, S: tl.constexpr, BLOCK_S: tl.constexpr,
                    NUM_BLOCKS: tl.constexpr, BLOCKS_P2: tl.constexpr):  # fmt: skip
    """dst[:count] = the `count` slots of largest key that this call does not hit (`row` where `hit`), in
    decreasing order (torch's stable descending sort, hits last). Takes slots in key order from `_key_pass`'s
    (x, best, best_at) and passes over hits: count plus at most the number of hits rounds."""
    found = 0
    while found < count:
        if NUM_BLOCKS == 1:  # every key in registers
            offs = tl.arange(0, BLOCK_S)
            victim = tl.argmax(x, 0, tie_break_left=True)  # ties: the lower slot
            x = tl.where(offs == victim, _TAKEN, x)
        else:
            tl.debug_barrier()  # the _TAKEN marks stored in earlier rounds are visible to every thread
            top = tl.max(best, 0)
            b = tl.min(tl.where(best == top, tl.arange(0, BLOCKS_P2), BLOCKS_P2), 0)  # ties: the lower block
            victim = tl.sum(tl.where(tl.arange(0, BLOCKS_P2) == b, best_at, 0), 0)
            tl.store(keys + victim, _TAKEN)
            offs = b * BLOCK_S + tl.arange(0, BLOCK_S)
            xb = tl.load(keys + offs, mask=offs < S, other=_TAKEN)
            xb = tl.where(offs == victim, _TAKEN, xb)  # the store above may not be visible to every thread yet
            best, best_at = _fold(xb, offs, b, tl.arange(0, BLOCKS_P2), best, best_at)
        free = tl.sum((hit & (row == victim)).to(tl.int32), 0) == 0
        tl.store(dst + found, victim, mask=free)
        found += free.to(tl.int32)


@triton.jit
def _evict_and_map(slot_of, owner, src, dst, e, count, M, layer, L: tl.constexpr, E: tl.constexpr, S: tl.constexpr):
    """Apply the copy list (positions `e` < M) to the mapping, in torch's order: the victims' old keys lose their
    slot, then the new keys take theirs. -> the number of evictions."""
    in_m = e < M
    new = layer * E + tl.load(src + e, mask=in_m, other=0)  # [BLOCK_E]
    to = tl.load(dst + e, mask=in_m, other=S)
    old = tl.load(owner + to, mask=in_m, other=-1)  # evicted keys, -1 for free slots and the scratch slot
    evicted = old >= 0
    tl.debug_barrier()  # every read of owner before the writes below
    tl.store(slot_of + tl.where(evicted, old, L * E), -1, mask=in_m)
    tl.debug_barrier()  # entries past count write the scratch entry L*E in both scatters: torch's order
    valid = e < count
    tl.store(slot_of + tl.where(valid, new, L * E), to, mask=in_m)
    tl.store(owner + to, tl.where(valid, new, -1), mask=in_m)
    return tl.sum(evicted.to(tl.int32), 0)


@triton.jit
def _update_scored(freq, last, reuse, layer, needed, e, E: tl.constexpr, FREQ: tl.constexpr,
                   KEEP_FREQ: tl.constexpr, REUSE: tl.constexpr, KEEP_REUSE: tl.constexpr):  # fmt: skip
    """`Scored.update`, one float64 rounding per torch op, in torch's order."""
    inside = e < E
    lst = tl.load(last + layer * E + e, mask=inside, other=0.0)  # [BLOCK_E] 0 or 1
    frq = tl.load(freq + layer * E + e, mask=inside, other=0.0)
    used = needed.to(tl.float64)
    one = tl.full([], 1.0, tl.float64)
    seen = tl.sum(lst, 0)  # counts: exact in any order
    seen = tl.where(seen < one, one, seen)
    reused = tl.sum(used * lst, 0) / seen
    # torch's cumsum is sequential, in expert order; `last` is 0 or 1, so only its ones add to the sum
    ones = lst != 0.0
    rank = tl.cumsum(ones.to(tl.int32), 0) - 1
    acc = tl.zeros([], tl.float64)
    for j in range(tl.sum(ones.to(tl.int32), 0)):
        acc += tl.sum(tl.where(ones & (rank == j), lst * frq, 0.0), 0)  # exactly one term: exact
    chance = acc / seen
    floor = tl.full([], 1e-12, tl.float64)
    spread = one - chance
    rho = (reused - chance) / tl.where(spread < floor, floor, spread)
    rho = tl.where(rho < 0.0, 0.0, rho)
    r = tl.load(reuse + layer)
    tl.debug_barrier()  # every read of the layer's state before the writes below
    tl.store(reuse + layer, r * tl.full([], KEEP_REUSE, tl.float64) + rho * tl.full([], REUSE, tl.float64))
    new_freq = frq * tl.full([], KEEP_FREQ, tl.float64) + used * tl.full([], FREQ, tl.float64)
    tl.store(freq + layer * E + e, new_freq, mask=inside)
    tl.store(last + layer * E + e, used, mask=inside)


@triton.jit(do_not_specialize=["n_ids", "M", "layer", "expert_bytes", "stride_x", "H", "max_tokens", "top_k"])
def _ensure(ids, slots, src, dst, count_out, cpu, cpu_count_out, cpu_take, slot_of, owner, clock, stats, last_use,
            freq, last, reuse, keys, need_mark, arrived, tick, mailbox, bank_a, bank_b, n_ids, M, layer, expert_bytes,
            x, stride_x, cpu_x, H, max_tokens, top_k,
            L: tl.constexpr, E: tl.constexpr, S: tl.constexpr, SCORED: tl.constexpr, STATS: tl.constexpr,
            NUM_STATS: tl.constexpr, SPLIT: tl.constexpr,
            FREQ: tl.constexpr, KEEP_FREQ: tl.constexpr, REUSE: tl.constexpr, KEEP_REUSE: tl.constexpr,
            BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, NUM_BLOCKS: tl.constexpr,
            BLOCKS_P2: tl.constexpr, POST: tl.constexpr, RING: tl.constexpr, MAX_ENTRIES: tl.constexpr,
            WIDTH: tl.constexpr, POST_CPU: tl.constexpr, BLOCK_X: tl.constexpr,
            PDL: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    # Before the wait, while the router runs: only what earlier calls of this kernel wrote (see the docstring)
    if PREFETCH:  # the layer's state (8-byte entries) into L2 for the phases after the wait
        prefetch_l2(slot_of + layer * E, E * 8)
        if SCORED:
            prefetch_l2(freq + layer * E, E * 8)
            prefetch_l2(last + layer * E, E * 8)
    now = tl.load(clock) + 1
    keys_x, best, best_at = _key_pass(keys, owner, last_use, freq, last, reuse, now, layer, L, E, S, SCORED,
                                      BLOCK_S, NUM_BLOCKS, BLOCKS_P2)  # fmt: skip
    wait_for_inputs(PDL)
    tl.debug_barrier()  # every thread has read the clock before it moves
    tl.store(clock, now)
    for n0 in range(0, n_ids, BLOCK_N):  # scatter, not compare: any number of ids costs O(ids + E)
        n = n0 + tl.arange(0, BLOCK_N)
        tl.store(need_mark + tl.load(ids + n, mask=n < n_ids, other=0), now, mask=n < n_ids)
    tl.debug_barrier()
    e = tl.arange(0, BLOCK_E)  # experts, and positions in the copy list (M <= E)
    in_e = e < E
    needed = tl.load(need_mark + e, mask=in_e, other=0) == now  # [BLOCK_E]
    row = tl.load(slot_of + layer * E + e, mask=in_e, other=-1)  # [BLOCK_E] before this call's updates
    hit = needed & (row >= 0)
    miss = needed & (row < 0)
    misses = tl.sum(miss.to(tl.int32), 0)
    on_cpu = tl.zeros([], tl.int32)
    if SPLIT:  # the CPU split's share of the misses
        on_cpu = tl.load(cpu_take + misses).to(tl.int32)
    count = misses - on_cpu  # copied: the first `count` misses in expert order, the rest to the CPU
    rank = tl.cumsum(miss.to(tl.int32), 0) - 1
    tl.store(src + rank, e, mask=miss & (rank < count))
    tl.store(cpu + rank - count, e, mask=miss & (rank >= count))
    pad = (e >= count) & (e < M)
    tl.store(src + e, 0, mask=pad)
    tl.store(dst + e, S, mask=pad)
    tl.store(cpu + e, 0, mask=(e >= on_cpu) & (e < M))
    tl.store(count_out, count)
    tl.store(cpu_count_out, on_cpu)
    tl.store(arrived + e, 0, mask=e < M)  # the miss copy's arrival counters (edgemoe.kernels.miss_copy.Arrivals)
    if count > 0:
        _choose_victims(keys_x, best, best_at, keys, dst, count, row, hit, S, BLOCK_S, NUM_BLOCKS, BLOCKS_P2)
    if POST:  # the list is final: to the copy service now, so the host's copies start during the phases below
        if (count > 0) | (on_cpu > 0):
            tl.debug_barrier()  # every thread's stores of src and dst first
            mail, seq = claim_row(tick, mailbox, RING, WIDTH)
            write_list(mail, src, dst, count.to(tl.int64), bank_a, bank_b, M, e, MAX_ENTRIES)
            if POST_CPU:  # the CPU's experts, the step's ids and its x, for the host to compute them
                write_cpu_list(mail, seq, layer, on_cpu, e, miss & (rank >= count), rank - count, ids, n_ids, top_k,
                               x, stride_x, cpu_x, H, max_tokens, MAX_ENTRIES, RING, BLOCK_N, BLOCK_X)  # fmt: skip
            else:
                tl.store(mail + _HEADER + 2 * MAX_ENTRIES + 1, 0)  # no CPU pairs
            publish_row(mail, seq)
    tl.debug_barrier()
    evictions = _evict_and_map(slot_of, owner, src, dst, e, count, M, layer, L, E, S)
    tl.debug_barrier()
    row = tl.load(slot_of + layer * E + e, mask=in_e, other=-1)  # torch's `row` is a view: read it again
    for n0 in range(0, n_ids, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        expert = tl.load(ids + n, mask=n < n_ids, other=0)
        tl.store(slots + n, tl.load(slot_of + layer * E + expert, mask=n < n_ids, other=-1), mask=n < n_ids)
    if SCORED:
        _update_scored(freq, last, reuse, layer, needed, e, E, FREQ, KEEP_FREQ, REUSE, KEEP_REUSE)
    else:
        tl.store(last_use + tl.where(needed & (row >= 0), row, S), now, mask=in_e)  # CPU experts: no slot
    if STATS:
        j = tl.arange(0, 8)
        add = tl.where(j == 0, tl.sum(needed.to(tl.int32), 0), tl.sum(hit.to(tl.int32), 0))
        add = tl.where(j == 2, misses, add)
        add = tl.where(j == 3, evictions, add)
        add = tl.where(j == 5, on_cpu, add)
        add = tl.where(j == 4, count.to(tl.int64) * expert_bytes, add.to(tl.int64))
        at = stats + layer * NUM_STATS + j
        add += tl.load(at, mask=j < NUM_STATS, other=0)
        tl.debug_barrier()  # no thread reads a counter after another wrote it
        tl.store(at, add, mask=j < NUM_STATS)


def ensure_fused(
    cache: CacheState,
    layer: int,
    ids: torch.Tensor,
    block_s: int | None = None,
    post: PostTarget | None = None,
    cpu_take: torch.Tensor | None = None,
    x: torch.Tensor | None = None,
) -> Ensured:
    """`ExpertCache.ensure` in one launch (see the module docstring); `block_s` is for tests of several blocks.
    `post`: a copy service's mailbox (CUDA), to which the kernel posts a non-empty copy list itself once its victims
    are chosen (`edgemoe.kernels.miss_copy.post_list`); the result is then `posted`. `cpu_take`: the CPU split's
    table (`ExpertCache._ensure_torch`); with a post, a list with CPU misses is posted too (even with no copies),
    with the step's ids and `x` [tokens, hidden] (the MoE input the CPU computes them from)."""
    L, E, S = cache.num_layers, cache.num_experts, cache.num_slots
    flat = ids.reshape(-1)
    M = min(flat.numel(), E)  # the most misses this call can have
    assert M <= S, "more distinct experts than slots: split them into waves"
    if cache.ensure_scratch is None:  # CPU caches (the interpreter's tests); CUDA caches allocate it up front
        cache.ensure_scratch = torch.zeros(S + 2 * E, dtype=torch.long, device=cache.device)
    keys, need_mark, arrived = cache.ensure_scratch.split([S, E, E])
    state: PolicyState = cache.policy.kernel_state()
    slots = torch.empty(flat.shape, dtype=torch.long, device=flat.device)
    src = torch.empty(M, dtype=torch.long, device=flat.device)
    dst = torch.empty(M, dtype=torch.long, device=flat.device)
    count = torch.empty((), dtype=torch.long, device=flat.device)
    cpu = torch.empty(M, dtype=torch.long, device=flat.device)
    cpu_count = torch.empty((), dtype=torch.long, device=flat.device)
    block_s = min(block_s or BLOCK_S, triton.next_power_of_2(S))
    num_blocks = triton.cdiv(S, block_s)
    if post is not None:
        assert M <= post.max_entries, "a copy list longer than the mailbox row"
    target = post or PostTarget(cache.clock, cache.clock, 0, 0, 1, 1)  # unread without a post
    post_cpu = post is not None and cpu_take is not None
    if post_cpu:  # the step's CPU pairs go to the service too: its ids and x with them
        tokens, top_k = (1, flat.numel()) if ids.dim() < 2 else (flat.numel() // ids.shape[-1], ids.shape[-1])
        assert post.cpu_x is not None, "a split posted to a copy service without CPU pairs"
        assert x is not None and x.shape[0] == tokens and x.stride(-1) == 1, "the CPU pairs' x: [tokens, hidden]"
        assert flat.numel() <= post.max_pairs and tokens <= post.cpu_x.shape[1], "more pairs than the mailbox holds"
    else:
        x, top_k = flat, 1  # unread
    cpu_x = target.cpu_x if post_cpu else flat
    # fmt: off
    _ensure[(1,)](
        flat, slots, src, dst, count, cpu, cpu_count, count if cpu_take is None else cpu_take, cache.slot_of,
        cache.owner, cache.clock, cache.stats, state.last_use, state.freq, state.last, state.reuse, keys, need_mark,
        arrived, target.tick,
        target.mailbox, target.bank_a, target.bank_b, flat.numel(), M, layer, cache.expert_bytes,
        x, x.stride(0) if post_cpu else 0, cpu_x, x.shape[-1] if post_cpu else 0,
        cpu_x.shape[1] if post_cpu else 0, top_k,
        L=L, E=E, S=S, SCORED=state.scored, STATS=cache.collect_stats,
        NUM_STATS=cache.stats.shape[1], SPLIT=cpu_take is not None,
        FREQ=state.freq_rate, KEEP_FREQ=1 - state.freq_rate, REUSE=state.reuse_rate, KEEP_REUSE=1 - state.reuse_rate,
        BLOCK_E=triton.next_power_of_2(E), BLOCK_N=BLOCK_N, BLOCK_S=block_s, NUM_BLOCKS=num_blocks,
        BLOCKS_P2=triton.next_power_of_2(num_blocks), POST=post is not None, RING=target.ring,
        MAX_ENTRIES=target.max_entries, WIDTH=target.width, POST_CPU=post_cpu, BLOCK_X=BLOCK_X,
        PREFETCH=use_pdl(flat.device) and E % 2 == 0,
        **launch_args(flat.device),  # (prefetch: sm_90+, 16-byte multiples of int64 entries)
        num_warps=NUM_WARPS, num_stages=1, enable_fp_fusion=False,  # no FMA: torch rounds mul and add apart
    )
    # fmt: on
    return Ensured(slots.view(ids.shape), src, dst, count, posted=post is not None, cpu=cpu, cpu_count=cpu_count)
