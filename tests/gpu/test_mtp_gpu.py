"""MTP speculation on CUDA (`--speculative mtp`): the decode graphs hand the head their static hidden states, the head
runs eagerly after each step, and the greedy tokens equal plain decoding's, resident and with offloaded experts; the
drafts equal transformers' reference head's (float32; tests/engine/test_mtp.py says how it is built)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_mtp import check_drafts, check_greedy, mtp_checkpoint  # noqa: F401 - the fixture

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

CUDA = dict(device="cuda", dtype="float32", progress=False)


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
def test_greedy_identical_with_graphs(mtp_checkpoint, offload: bool) -> None:  # noqa: F811
    opts = CUDA | dict(max_num_seqs=6)
    if offload:
        opts |= dict(moe_strategy="offload", moe_cache_fraction=0.5)
    check_greedy(mtp_checkpoint[0], **opts)


@pytest.mark.parametrize("steered", [False, True], ids=["own-drafts", "steered-drafts"])
def test_drafts_match_transformers_reference(mtp_checkpoint, steered: bool) -> None:  # noqa: F811
    check_drafts(*mtp_checkpoint, steered, **CUDA, max_num_seqs=4)
