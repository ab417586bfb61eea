"""The RAM tier under `--ram-budget` (`edgemoe/offload/ram_tier.c` through `RamTier`) and the expert store it reads
(`edgemoe.offload.expert_store.ExpertStore`), on the CPU, over stores written here with seeded random experts.

Checked against independent references: the tier's policy against `LruReference`, a plain-Python LRU (per call, hits
touched first in call order, then each miss evicts the least recently used expert this call did not touch): which
experts are resident after every call of a seeded random sequence, the counters (accesses, hits, reads, bytes), that
a resident expert never moves row, and that every resident row holds the bytes written for its expert, read back from
the store file with plain Python; `reset` empties it, bad arguments are refused without harm. The store: reused (meta
banks, the file untouched) only with the same source and layouts and an intact file (not after truncation or an edited
header), a temporary file until `finish` and none after `discard`, the next folder where one cannot be written, one
line where none has room. Read errors: a store truncated or touched after the tier opened it, or shorter than its
header says, fails the fetch with one line saying so; the error is sticky and the failed experts are not resident.
The copy service's serve loop with a tier (the fake CUDA driver of tests/offload/test_copy_service.py): lists that name
a layer and experts, around the ring, land as the store's bytes in their slots (one run an expert, or two rows), every
entry's counter written; a failing tier raises naming the RAM tier, copies nothing, and still releases every waiter.
"""

from __future__ import annotations

import errno
import json
import os
import types
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.offload import expert_store
from edgemoe.offload.copy_service import RING, CopyService
from edgemoe.offload.expert_store import HEADER_BYTES, MAGIC, ExpertStore
from edgemoe.offload.layout import ExpertLayout
from edgemoe.offload.ram_tier import RamTier
from tests.offload.test_copy_service import CHUNKS, NOT_READY, HostGPU

E, ROWS = 8, 5
H, INTER = 16, 8  # a float32 row: 1536 bytes, so the store's stride (4 KiB) holds more than the row
LAYOUTS = [
    ExpertLayout(H, INTER, torch.float32),
    ExpertLayout(H, INTER, torch.bfloat16),  # a shorter row: the store's row is the longest layer's
    ExpertLayout(H, INTER, torch.float32),
]
L = len(LAYOUTS)


def write_store(folder: Path, source: object = "checkpoint-a", layouts: list[ExpertLayout] = LAYOUTS,
                seed: int = 0) -> tuple[ExpertStore, dict[tuple[int, int], bytes]]:  # fmt: skip
    """A finished store of seeded random experts -> (store, the bytes of each (layer, expert) as the tier must serve
    them: what was written into its bank, zero-padded to the store's row)."""
    store = ExpertStore([folder], E, layouts, source)
    assert not store.reused
    gen = torch.Generator().manual_seed(seed)
    want = {}
    for layer, layout in enumerate(layouts):
        bank = store.banks(layout, layer)
        assert bank.shape == (E, layout.row) and bank.dtype == layout.dtype
        bank.copy_(torch.randn(E, layout.row, generator=gen).to(layout.dtype))
        for e in range(E):
            raw = bank[e].contiguous().view(torch.uint8).numpy().tobytes()
            want[layer, e] = raw.ljust(store.row_bytes, b"\0")
    store.finish()
    return store, want


def file_bytes(path: Path, store: ExpertStore, layer: int, expert: int) -> bytes:
    """(layer, expert)'s row as the file holds it, read with plain Python at the offset the format documents."""
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES + (layer * store.experts + expert) * store.stride)
        return f.read(store.row_bytes)


class LruReference:
    """The tier's policy in plain Python: `rows` entries, least recently used first."""

    def __init__(self, rows: int) -> None:
        self.rows, self.order = rows, OrderedDict()
        self.accesses = self.hits = self.reads = self.evictions = 0

    def fetch(self, layer: int, experts: list[int]) -> None:
        keys = [(layer, e) for e in experts]
        hits = [k for k in keys if k in self.order]
        for k in hits:  # touched first, in call order
            self.order.move_to_end(k)
        for k in keys:
            self.accesses += 1
            if k in hits:
                self.hits += 1
                continue
            if len(self.order) == self.rows:
                victim = next(v for v in self.order if v not in keys)  # the least recent this call did not touch
                del self.order[victim]
                self.evictions += 1
            self.order[k] = None
            self.reads += 1


def resident(tier: RamTier) -> dict[tuple[int, int], int]:
    """(layer, expert) -> RAM row, for every resident expert."""
    rows = {(layer, e): tier.row_of(layer, e) for layer in range(tier.layers) for e in range(tier.experts)}
    return {k: r for k, r in rows.items() if r >= 0}


def assert_rows_hold(tier: RamTier, rows: dict[tuple[int, int], int], want: dict[tuple[int, int], bytes]) -> None:
    for key, row in rows.items():
        assert tier.pool[row, : tier.row_bytes].numpy().tobytes() == want[key], key


def test_policy_and_contents_match_an_lru_reference(tmp_path: Path) -> None:
    store, want = write_store(tmp_path)
    for (layer, e), raw in want.items():  # the reference bytes are the file's, at the documented offsets
        assert file_bytes(store.path, store, layer, e) == raw
    tier = RamTier(store, ROWS, pin=False)
    assert tier.pool.shape == (ROWS, store.stride) and tier.pool.data_ptr() % 4096 == 0
    ref = LruReference(ROWS)
    # bad arguments: refused before anything changes, and not sticky
    for layer, experts in ((L, [0]), (0, list(range(ROWS + 1))), (1, [E, 0])):
        with pytest.raises(EdgeMoEError, match="Invalid argument"):
            tier.fetch(layer, torch.tensor(experts))
    assert resident(tier) == {} and tier.stats()["accesses"] == 0 and tier.stats()["error"] == 0

    gen = torch.Generator().manual_seed(11)
    before: dict[tuple[int, int], int] = {}
    for _ in range(80):
        layer = int(torch.randint(L, (1,), generator=gen))
        n = int(torch.randint(1, ROWS + 1, (1,), generator=gen))
        pool = 4 if int(torch.randint(2, (1,), generator=gen)) else E  # a smaller choice half the time: more hits
        experts = torch.randperm(pool, generator=gen)[:n].tolist()
        rows = tier.fetch(layer, torch.tensor(experts))
        ref.fetch(layer, experts)
        now = resident(tier)
        assert set(now) == set(ref.order)
        assert rows.tolist() == [now[layer, e] for e in experts]
        assert len(set(now.values())) == len(now) and all(0 <= r < ROWS for r in now.values())
        assert all(now[k] == r for k, r in before.items() if k in now), "a resident expert moved row"
        assert_rows_hold(tier, now, want)  # the call's rows, and no read landed in another expert's row
        stats = tier.stats()
        assert (stats["accesses"], stats["hits"], stats["reads"]) == (ref.accesses, ref.hits, ref.reads)
        assert stats["bytes_read"] == ref.reads * store.row_bytes and stats["error"] == 0
        before = now
    assert ref.hits > 0 and ref.evictions > 0 and ref.reads > ROWS  # the sequence exercised all three
    assert tier.stats()["hit_rate"] == ref.hits / ref.accesses

    tier.reset()
    assert resident(tier) == {}
    stats = tier.stats()
    assert (stats["accesses"], stats["hits"], stats["reads"], stats["bytes_read"]) == (0, 0, 0, 0)
    rows = tier.fetch(2, torch.tensor([5, 0, 3]))  # everything read again
    assert tier.stats()["reads"] == 3 and tier.stats()["hits"] == 0
    assert_rows_hold(tier, {(2, e): int(r) for e, r in zip([5, 0, 3], rows)}, want)
    tier.close()


def test_store_is_reused_only_when_source_layouts_and_file_match(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    folder.mkdir()
    first = ExpertStore([folder], E, LAYOUTS, "checkpoint-a")
    assert not first.reused and first.path.parent == folder and not first.path.exists()
    (tmp,) = folder.glob("*.tmp")  # written under a temporary name until finished
    assert tmp.stat().st_size == first.size == HEADER_BYTES + L * E * first.stride
    first.discard()
    assert list(folder.iterdir()) == []

    store, want = write_store(folder)
    assert [p.name for p in folder.iterdir()] == [store.path.name] and store.path.stat().st_size == store.size
    head = store.path.read_bytes()[:HEADER_BYTES]
    assert head.startswith(MAGIC) and json.loads(head[len(MAGIC) :].rstrip(b" ")) == store.header
    stamp = store.path.stat()

    again = ExpertStore([folder], E, LAYOUTS, "checkpoint-a")
    assert again.reused and again.path == store.path
    for layer, layout in enumerate(LAYOUTS):
        bank = again.banks(layout, layer)
        assert bank.device.type == "meta" and bank.shape == (E, layout.row)
        bank.copy_(torch.ones(E, layout.row))  # what the loader does: nothing reaches the file
    again.finish()
    again.discard()
    after = store.path.stat()
    assert (after.st_mtime_ns, after.st_ino, after.st_size) == (stamp.st_mtime_ns, stamp.st_ino, stamp.st_size)
    assert [p.name for p in folder.iterdir()] == [store.path.name]
    assert all(file_bytes(store.path, store, layer, e) == raw for (layer, e), raw in want.items())

    other_source = ExpertStore([folder], E, LAYOUTS, "checkpoint-b")
    other_layouts = ExpertStore([folder], E, [ExpertLayout(H, INTER, torch.bfloat16)] * L, "checkpoint-a")
    other_count = ExpertStore([folder], E, LAYOUTS[:2], "checkpoint-a")
    for other in (other_source, other_layouts, other_count):
        assert not other.reused and other.path != store.path
        other.discard()
    assert [p.name for p in folder.iterdir()] == [store.path.name]


def damaged(path: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(path, path.stat().st_size - 4096)
    elif how == "header-edited":  # same length, still JSON, another number of experts
        data = path.read_bytes()
        edited = data.replace(f'"experts": {E}'.encode(), f'"experts": {E + 1}'.encode(), 1)
        assert edited != data and len(edited) == len(data)
        path.write_bytes(edited)
    elif how == "magic":
        with open(path, "r+b") as f:
            f.write(b"X")
    elif how == "garbage-header":
        with open(path, "r+b") as f:
            f.seek(len(MAGIC))
            f.write(b"{not json")


@pytest.mark.parametrize("how", ["truncated", "header-edited", "magic", "garbage-header"])
def test_a_damaged_store_is_written_again(tmp_path: Path, how: str) -> None:
    store, _ = write_store(tmp_path)
    damaged(store.path, how)
    rewritten, want = write_store(tmp_path, seed=1)  # asserts it is not reused
    assert rewritten.path == store.path and [p.name for p in tmp_path.iterdir()] == [store.path.name]
    assert ExpertStore([tmp_path], E, LAYOUTS, "checkpoint-a").reused
    assert all(file_bytes(store.path, rewritten, layer, e) == raw for (layer, e), raw in want.items())


def test_store_folders_in_order_and_one_line_when_none_fits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    unwritable = tmp_path / "a-file" / "experts"  # (as root a read-only mode would not stop the writes)
    good = tmp_path / "good"
    store = ExpertStore([unwritable, good], E, LAYOUTS, "checkpoint-a")
    assert not store.reused and store.path.parent == good
    store.discard()
    finished, _ = write_store(good)
    elsewhere = tmp_path / "empty"
    elsewhere.mkdir()
    found = ExpertStore([elsewhere, good], E, LAYOUTS, "checkpoint-a")  # a complete store in any folder is reused
    assert found.reused and found.path == finished.path and list(elsewhere.iterdir()) == []

    small = tmp_path / "small"
    small.mkdir()
    monkeypatch.setattr(expert_store.shutil, "disk_usage", lambda folder: types.SimpleNamespace(free=4096))
    with pytest.raises(EdgeMoEError) as info:
        ExpertStore([unwritable, small], E, LAYOUTS, "checkpoint-b")
    text = str(info.value)
    assert "\n" not in text and text.startswith("the expert store needs")
    assert f"cannot write {unwritable}" in text and f"{small} has 0.0 GiB free" in text
    assert list(small.iterdir()) == []


def test_a_store_truncated_under_the_tier_fails_and_the_error_sticks(tmp_path: Path) -> None:
    store, want = write_store(tmp_path)
    tier = RamTier(store, ROWS, pin=False)
    tier.fetch(0, torch.tensor([0, 1]))
    os.truncate(store.path, HEADER_BYTES + E * store.stride)  # layer 0 kept
    with pytest.raises(EdgeMoEError, match="the RAM tier of the experts failed: the expert store changed on disk"):
        tier.fetch(1, torch.tensor([2, 3, 4]))
    assert all(tier.row_of(1, e) == -1 for e in (2, 3, 4))  # nothing is served from the rows it was reading
    assert tier.stats()["error"] == errno.ESTALE and tier.stats()["reads"] == 2
    with pytest.raises(EdgeMoEError, match="changed on disk"):  # sticky, even for experts in RAM
        tier.fetch(0, torch.tensor([0]))
    assert_rows_hold(tier, resident(tier), want)


def test_a_store_shorter_than_its_experts_is_a_short_read(tmp_path: Path) -> None:
    store, want = write_store(tmp_path)
    os.truncate(store.path, HEADER_BYTES + (E + 3) * store.stride + 100)  # layer 1's experts 0-2, 100 bytes of 3
    tier = RamTier(store, ROWS, pin=False)
    for experts in ([1, 6], [3]):  # several reads at once (the reader threads), then one (on the calling thread)
        fresh = RamTier(store, ROWS, pin=False)
        with pytest.raises(EdgeMoEError, match="a read of the expert store failed or came back short"):
            fresh.fetch(1, torch.tensor(experts))
        assert fresh.row_of(1, experts[-1]) == -1 and fresh.stats()["error"] == errno.EIO
        assert_rows_hold(fresh, resident(fresh), want)  # whatever stayed resident was read whole
        with pytest.raises(EdgeMoEError, match="came back short"):
            fresh.fetch(1, torch.tensor([0]))
        fresh.close()
    tier.fetch(1, torch.tensor([0, 2]))  # the experts before the cut read whole
    assert_rows_hold(tier, resident(tier), want)
    assert len(resident(tier)) == 2


def test_a_store_touched_under_the_tier_fails(tmp_path: Path) -> None:
    store, _ = write_store(tmp_path)
    tier = RamTier(store, ROWS, pin=False)
    tier.fetch(2, torch.tensor([7]))
    stat = store.path.stat()
    os.utime(store.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(EdgeMoEError, match="the expert store changed on disk since it was opened"):
        tier.fetch(2, torch.tensor([6]))
    assert tier.row_of(2, 6) == -1 and tier.stats()["error"] == errno.ESTALE


# ---------------------------------------------------------------------------------- the copy service's serve loop

S = 6  # slots of the fake device pool (and its scratch slot)


class TierGPU(HostGPU):
    """`HostGPU` posting lists of the RAM tier (`CopyService.tier_target`: the MoE layer in both bank fields, expert
    ids as sources). At each of its turns, once the last list is served, it keeps a copy of the slot pools and of the
    counters (asserting inside a ctypes callback would be swallowed)."""

    def __init__(self, lists: list[tuple[int, list[int], list[int]]], pools: tuple[torch.Tensor, ...], **kw) -> None:
        super().__init__([], **kw)
        self.tier_lists, self.pools = list(lists), pools
        self.seen: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]] = []

    def query(self, event: int) -> int:
        self.queries += 1
        service = self.service
        if int(service.tick) > service.served:
            return NOT_READY
        if service.served > len(self.seen):
            self.seen.append((tuple(p.clone() for p in self.pools), service.counters.clone()))
        if self.tier_lists:
            service.counters.zero_()  # as ensure does before each list
            post_tier(service, *self.tier_lists.pop(0))
            return NOT_READY
        return 0


def post_tier(service: CopyService, layer: int, experts: list[int], slots: list[int]) -> None:
    """What the GPU's post kernel writes for a tier list (`tier_target(layer)`), its sequence number last."""
    target = service.tier_target(layer)
    assert (target.bank_a, target.bank_b) == (layer, layer)
    seq = int(service.tick) + 1
    service.tick.fill_(seq)
    row, width = service.mailbox[(seq - 1) % RING], service.max_entries
    row[1:4] = torch.tensor([len(experts), layer, layer])
    row[4 : 4 + len(experts)] = torch.tensor(experts)
    row[4 + width : 4 + width + len(slots)] = torch.tensor(slots)
    row[0] = seq


def tier_service(tmp_path: Path, lists: list, joined: bool, batched: bool, group: int):
    """A copy service over fake device pools, serving `lists` from a RAM tier over a fresh store -> (gpu, pools,
    tier, the store's bytes by (layer, expert), the layout)."""
    layout = ExpertLayout(H, INTER, torch.float32)
    store, want = write_store(tmp_path, layouts=[layout] * L)
    tier = RamTier(store, ROWS, pin=False)
    gen = torch.Generator().manual_seed(9)
    if joined:  # the engine's layout: an expert's two rows one run of memory a slot
        storage = torch.randn(S + 1, layout.row, generator=gen)
        pools = layout.copy_views(storage)
    else:
        pools = (torch.randn(S + 1, 2 * INTER, H, generator=gen), torch.randn(S + 1, H, INTER, generator=gen))
    a, b = layout.copy_views(layout.empty(1))
    counters = torch.zeros(E, dtype=torch.int64)
    gpu = TierGPU(lists, pools, batched=batched)
    gpu.service = CopyService(pools, counters, CHUNKS, E, group=group, driver=gpu)
    assert gpu.service.joined == joined
    gpu.service.attach_tier(tier, b.data_ptr() - a.data_ptr())
    return gpu, pools, tier, want, layout


def slot_bytes(pools: tuple[torch.Tensor, ...], slot: int) -> bytes:
    """A slot's expert as one run of bytes: gate_up's row, then down's."""
    return b"".join(p[slot].contiguous().view(torch.uint8).numpy().tobytes() for p in pools)


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "two-rows"])
@pytest.mark.parametrize(("batched", "group"), [(False, 1), (True, 2)])
def test_serve_copies_each_list_from_the_tier(tmp_path: Path, joined: bool, batched: bool, group: int) -> None:
    gen = torch.Generator().manual_seed(4)
    lists = []
    for step in range(3 * RING + 2):  # around the ring of mailbox rows several times, every layer
        n = 1 + step % ROWS
        experts = torch.randperm(E if step % 2 else 4, generator=gen)[:n].tolist()  # half over 4: tier hits
        lists.append((step % L, experts, torch.randperm(S, generator=gen)[:n].tolist()))
    gpu, pools, tier, want, _ = tier_service(tmp_path, lists, joined, batched, group)
    start = tuple(p.clone() for p in pools)
    gpu.service.serve()
    assert gpu.service.served == len(lists) and len(gpu.seen) == len(lists)

    expected, ref = [slot_bytes(start, s) for s in range(S + 1)], LruReference(ROWS)
    for (layer, experts, slots), (seen, counters) in zip(lists, gpu.seen):
        ref.fetch(layer, experts)
        for e, s in zip(experts, slots):
            expected[s] = want[layer, e]
        assert [slot_bytes(seen, s) for s in range(S + 1)] == expected  # its slots, and no other
        n = len(experts)
        assert counters[:n].tolist() == [CHUNKS] * n and not counters[n:].any()
    stats = tier.stats()
    assert (stats["accesses"], stats["hits"], stats["reads"]) == (ref.accesses, ref.hits, ref.reads)
    assert ref.hits > 0 and ref.evictions > 0
    entries = [(addr - gpu.service.counters.data_ptr()) // 8 for addr, _, _ in gpu.writes]
    assert entries == [i for _, experts, _ in lists for i in range(len(experts))]  # each entry's counter, once
    assert gpu.copies == (1 if joined else 2) * sum(len(x) for _, x, _ in lists)  # joined: an entry is one copy


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "two-rows"])
def test_a_failing_tier_raises_and_still_releases_the_waiters(tmp_path: Path, joined: bool) -> None:
    gpu, pools, tier, want, _ = tier_service(tmp_path, [(0, [1, 2], [0, 1])], joined, True, 2)
    gpu.service.serve()
    assert slot_bytes(pools, 0) == want[0, 1] and slot_bytes(pools, 1) == want[0, 2]
    before, writes = tuple(p.clone() for p in pools), len(gpu.writes)
    os.truncate(tier.source.path, HEADER_BYTES + E * tier.source.stride)
    failing = [(1, [3, 4, 5], [2, 3, 4]), (0, [1], [5])]  # misses; then a hit, after the error (sticky)
    gpu.tier_lists = list(failing)
    with pytest.raises(EdgeMoEError, match="the RAM tier of the experts failed: the expert store changed on disk"):
        gpu.service.serve()
    assert gpu.service.served == 3  # both lists served: the GPU waited on none forever
    for p, q in zip(pools, before):
        assert torch.equal(p, q)  # nothing copied from a failed fetch
    written = [((addr - gpu.service.counters.data_ptr()) // 8, value) for addr, _, value in gpu.writes[writes:]]
    assert written == [(0, CHUNKS), (1, CHUNKS), (2, CHUNKS), (0, CHUNKS)]
    assert gpu.service._state.tier_error == errno.ESTALE
