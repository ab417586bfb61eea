"""The PLE row gather (`gather_rows`, Triton's interpreter on CPU) against `gather_rows_reference` (`index_select`),
bitwise: repeated and unordered ids, rows shorter than a block (masked), a whole number of blocks, and several blocks
with a partial last one; float32 and bfloat16; no ids."""

from __future__ import annotations

import pytest
import torch

from edgemoe.kernels.ple_gather import BLOCK, gather_rows
from edgemoe.layers.ple import gather_rows_reference
from tests.kernels import interpreter_only

pytestmark = interpreter_only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("row", [24, 64, 2 * BLOCK + 40])
def test_gather_matches_index_select(row: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(row)
    table = torch.randn(37, row, generator=gen).to(dtype)
    ids = torch.tensor([5, 36, 0, 5, 17, 5])
    out = gather_rows(table, ids)
    assert out.dtype == dtype and out.shape == (6, row)
    assert torch.equal(out, gather_rows_reference(table, ids))


def test_no_ids() -> None:
    assert gather_rows(torch.ones(4, 8), torch.zeros(0, dtype=torch.long)).shape == (0, 8)
