"""The two-bank miss copy (`copy_rows_pair`, Triton's interpreter on CPU) against `copy_rows_reference` applied to each
bank: rows of both banks of an expert (gate_up [2I, H] and down [H, I]) in one launch, rows of several chunks and of
a partial last chunk in either bank, empty, partial and full copy lists, banks of different dtypes, persistent grids
of one program (every item in turn), a few, and more programs than items, and rows side by side in one allocation
(the engine's layout, `split_rows`) in the banks, the pools or both.
`copy_rows` (one bank) goes through the same kernel: tests/kernels/test_ensure_kernel.py."""

from __future__ import annotations

import pytest
import torch

from edgemoe.kernels.miss_copy import chunks_per_entry, copy_rows_pair
from edgemoe.offload.expert_cache import copy_rows_reference
from edgemoe.offload.layout import split_rows
from tests.kernels import interpreter_only

pytestmark = interpreter_only

E, S, M = 9, 7, 5


def random_list(count: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A copy list of capacity M: distinct experts to distinct slots; the entries past `count` are padding (expert 0
    to the scratch slot S, as `ensure` writes them)."""
    src, dst = torch.randperm(E, generator=gen)[:M], torch.randperm(S, generator=gen)[:M]
    valid = torch.arange(M) < count
    return torch.where(valid, src, 0), torch.where(valid, dst, S), torch.tensor(count)


# (gate_up row, down row, block): 6 x 4 = 24 = 3 blocks of 8 and 4 x 3 = 12, a partial second block; both partial;
# both whole blocks; a block larger than both rows (clamped to the larger row)
CASES = [((6, 4), (4, 3), 8), ((5, 3), (3, 7), 4), ((4, 4), (4, 2), 8), ((3, 5), (5, 1), 4096)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_pair_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    w13_row, w2_row, block = case
    gen = torch.Generator().manual_seed(sum(w13_row) + block)
    banks = torch.randn(E, *w13_row, generator=gen).to(dtype), torch.randn(E, *w2_row, generator=gen).to(dtype)
    for count in (0, 2, M):
        pools = tuple(torch.randn(S + 1, *b.shape[1:], generator=gen).to(dtype) for b in banks)
        expected = tuple(p.clone() for p in pools)
        src, dst, n = random_list(count, gen)
        for pool, bank in zip(expected, banks):
            copy_rows_reference(pool, bank, src, dst)
        copy_rows_pair(pools, banks, src, dst, n, block=block)
        for pool, want in zip(pools, expected):
            assert torch.equal(pool[:S], want[:S]), count  # the scratch slot S: only the reference writes it


@pytest.mark.parametrize("programs", [1, 2, 64])
def test_any_grid_size_copies_every_item(programs: int) -> None:
    gen = torch.Generator().manual_seed(programs)
    banks = torch.randn(E, 6, 4, generator=gen), torch.randn(E, 5, 3, generator=gen)  # 3 + 2 chunks of 8
    pools = tuple(torch.randn(S + 1, *b.shape[1:], generator=gen) for b in banks)
    want = tuple(p.clone() for p in pools)
    src, dst, n = random_list(M, gen)
    for pool, bank in zip(want, banks):
        copy_rows_reference(pool, bank, src, dst)
    copy_rows_pair(pools, banks, src, dst, n, block=8, programs=programs)
    for pool, w in zip(pools, want):
        assert torch.equal(pool, w)


def test_banks_of_different_dtypes_and_garbage_past_count() -> None:
    """Each bank keeps its own dtype; entries past `count` are never read, whatever they hold."""
    gen = torch.Generator().manual_seed(3)
    banks = torch.randn(E, 6, 4, generator=gen).to(torch.bfloat16), torch.randn(E, 4, 3, generator=gen)
    pools = torch.zeros(S + 1, 6, 4, dtype=torch.bfloat16), torch.zeros(S + 1, 4, 3)
    src, dst, n = random_list(3, gen)
    src[3:], dst[3:] = 10**12, -(10**12)  # would fault (or write anywhere) if read
    copy_rows_pair(pools, banks, src, dst, n, block=8)
    for pool, bank in zip(pools, banks):
        want = torch.zeros_like(pool)
        want[dst[:3]] = bank[src[:3]]
        assert torch.equal(pool, want)


def test_empty_copy_list_launches_nothing() -> None:
    banks = torch.randn(E, 4, 4), torch.randn(E, 4, 2)
    pools = torch.zeros(S + 1, 4, 4), torch.zeros(S + 1, 4, 2)
    empty = torch.zeros(0, dtype=torch.long)
    copy_rows_pair(pools, banks, empty, empty, torch.tensor(0))
    assert not any(p.any() for p in pools)


def test_mismatched_bank_and_pool() -> None:
    banks = torch.randn(E, 4, 4), torch.randn(E, 4, 2)
    pools = torch.zeros(S + 1, 4, 4), torch.zeros(S + 1, 2, 4)  # the down pool's rows are transposed
    src, dst, n = random_list(2, torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError):
        copy_rows_pair(pools, banks, src, dst, n)


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_arrival_counters_count_every_item(programs: int) -> None:
    """With counters (zeroed, as `ensure` leaves them), each valid entry ends at `chunks_per_entry` stored items and
    the padding entries stay at zero; the copy itself is unchanged."""
    gen = torch.Generator().manual_seed(10 + programs)
    banks = torch.randn(E, 6, 4, generator=gen), torch.randn(E, 5, 3, generator=gen)  # 3 + 2 chunks of 8
    for count in (0, 2, M):
        pools = tuple(torch.randn(S + 1, *b.shape[1:], generator=gen) for b in banks)
        want = tuple(p.clone() for p in pools)
        src, dst, n = random_list(count, gen)
        for pool, bank in zip(want, banks):
            copy_rows_reference(pool, bank, src, dst)
        arrived = torch.zeros(E, dtype=torch.long)
        copy_rows_pair(pools, banks, src, dst, n, arrived, block=8, programs=programs)
        assert chunks_per_entry(pools, block=8) == 5
        assert arrived.tolist() == [5] * count + [0] * (E - count)
        for pool, w in zip(pools, want):
            assert torch.equal(pool[:S], w[:S])


@pytest.mark.parametrize(("joined_banks", "joined_pools"), [(True, True), (True, False), (False, True)])
def test_rows_side_by_side(joined_banks: bool, joined_pools: bool) -> None:
    """Rows any distance apart: the engine's banks and pools hold an expert's two rows in one run of memory
    (`split_rows`: strided views); either side may be laid out so alone."""
    gen = torch.Generator().manual_seed(20 + 2 * joined_banks + joined_pools)
    inter, hidden = 3, 4  # gate_up rows [6, 4] = 3 chunks of 8, down rows [4, 3]: a partial second chunk
    joined = torch.randn(E, 3 * inter * hidden, generator=gen)
    banks = split_rows(joined, inter, hidden)
    if not joined_banks:
        banks = tuple(b.contiguous() for b in banks)
    for count in (0, 2, M):
        pools = split_rows(torch.randn(S + 1, 3 * inter * hidden, generator=gen), inter, hidden)
        if not joined_pools:
            pools = tuple(p.contiguous() for p in pools)
        want = tuple(p.clone() for p in pools)
        src, dst, n = random_list(count, gen)
        for pool, bank in zip(want, banks):
            copy_rows_reference(pool, bank, src, dst)
        arrived = torch.zeros(E, dtype=torch.long)
        copy_rows_pair(pools, banks, src, dst, n, arrived, block=8)
        assert arrived.tolist() == [5] * count + [0] * (E - count)
        for pool, w in zip(pools, want):
            assert torch.equal(pool[:S], w[:S]), count
