"""Experts read in place (`edgemoe.offload.in_place`): under `--ram-budget`, the RAM tier reads a GGUF's experts from
the file itself, with no expert store written.

Checked on the CPU: greedy tokens identical to the same file with every expert resident, for make-model's GGUF files
with experts in Q8_0, MXFP4, Q4_K/Q6_K (Q4_K_M), layers of Q4_K and Q8_0 mixed (rows of different lengths, padded) and
F32 (floats of the compute dtype), and for files written by llama.cpp's own converter (Q8_0 Qwen3-MoE; gpt-oss with
F32 experts and biases); no file written beside the GGUF nor in the cache folder, the start-up line naming the file. The
RAM rows equal, byte for byte, the rows of the expert store the same file gives with `--expert-store` and the experts'
bytes read from the file with the gguf package, zero-padded. The reader itself (`ram_tier.c` over a table of
segments): pieces at unaligned offsets and lengths, longer than its bounce buffer, ending at an unaligned end of file,
from two files, zeros, against plain Python; one past the end is a short read. A GGUF truncated or touched under a
running engine fails the step in one line naming the file. Where the loader converts experts (BF16 experts, float32
compute), the store is written as before.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from edgemoe import LLM, EdgeMoEError, SamplingParams
from edgemoe.engine.summary import startup_line
from edgemoe.offload import banks
from edgemoe.offload.in_place import InPlaceExperts
from edgemoe.offload.ram_tier import RamTier
from edgemoe.tools.make_model import make_model

gguf = pytest.importorskip("gguf")

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
ENGINE = dict(max_num_seqs=2, max_model_len=256, progress=False, dtype="float32")
OFFLOAD = dict(moe_strategy="offload", moe_cache_slots=4, moe_collect_stats=True)  # 4: max_num_seqs 2 x top-2


def prompts() -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(3, 6000, (n,), generator=g).tolist() for n in ns] for ns in ((13, 5), (4,))]


def tokens(llm: LLM) -> list[list[list[int]]]:
    return [[o.token_ids for o in llm.generate(batch, GREEDY)] for batch in prompts()]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The store's fallback folder, watched: reading in place writes nothing there either."""
    folder = tmp_path / "cache"
    monkeypatch.setattr(banks, "CACHE_DIR", folder)
    return folder


_FILES: dict = {}


def gguf_file(tmp_path_factory, size: str, expert_dtype: str) -> Path:
    """make-model's qwen3_moe as GGUF (float32 dense weights), alone in its folder; made once each."""
    if (size, expert_dtype) not in _FILES:
        out = tmp_path_factory.mktemp(f"gguf-{expert_dtype}")
        _FILES[size, expert_dtype] = make_model(out, "qwen3_moe", size, dtype="float32", format="gguf",
                                                expert_dtype=expert_dtype)  # fmt: skip
    return _FILES[size, expert_dtype]


def assert_in_place(llm: LLM, path: Path, cache_dir: Path, ran: bool = True) -> None:
    """Read in place: the tier's source is the file, it read from it (once `ran`), and nothing was written
    anywhere."""
    tier = llm.engine.expert_cache.tier
    assert isinstance(tier.source, InPlaceExperts) and tier.source.files == [path]
    stats = llm.engine.moe_stats()["ram_tier"]
    assert (stats["reads"] > 0) == ran and stats["error"] == 0
    assert sorted(path.parent.iterdir()) == [path] and not cache_dir.exists()
    assert f"all on disk (read in place from {path.name})" in startup_line(llm.engine)


CASES = [("tiny", "q8_0", "0.5"), ("tiny", "mxfp4", "0.17"), ("tiny-k", "q4_k_m", "0.5"), ("tiny-k", "mixed", "0.5"),
         ("tiny", "f32", "0.17")]  # fmt: skip


@pytest.mark.parametrize(("size", "expert_dtype", "budget"), CASES, ids=[c[1] for c in CASES])
def test_greedy_identical_reading_in_place(tmp_path_factory, cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                           size: str, expert_dtype: str, budget: str) -> None:  # fmt: skip
    path = gguf_file(tmp_path_factory, size, expert_dtype)
    want = tokens(LLM(str(path), **ENGINE))
    assert len({t for batch in want for ids in batch for t in ids}) > 5, "degenerate model"
    loaded = spy_on_expert_loads(monkeypatch)
    llm = LLM(str(path), **ENGINE, **OFFLOAD, ram_budget=budget)
    assert loaded == []  # the loader read no expert: the tier reads them from the file
    assert tokens(llm) == want
    assert_in_place(llm, path, cache_dir)
    stats = llm.engine.moe_stats()
    assert stats["ram_tier"]["accesses"] == stats["total"]["misses"] > 0


def spy_on_expert_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The expert tensors the GGUF loader reads from now on (blocks through `fit`, floats through `to_torch`)."""
    from edgemoe.models import loader
    from edgemoe.models.gguf import GGUFCheckpoint

    seen: list[str] = []
    fit, to_torch = loader.fit, GGUFCheckpoint.to_torch

    def spied_fit(t, shape, name):  # noqa: ANN001, ANN202
        seen.extend([name] if "_exps" in name else [])
        return fit(t, shape, name)

    def spied_to_torch(self, tensor, *args):  # noqa: ANN001, ANN202
        seen.extend([tensor.name] if "_exps" in tensor.name else [])
        return to_torch(self, tensor, *args)

    monkeypatch.setattr(loader, "fit", spied_fit)
    monkeypatch.setattr(GGUFCheckpoint, "to_torch", spied_to_torch)
    return seen


def file_rows(path: Path, layer: int, experts: list[int], row_bytes: int) -> list[bytes]:
    """Each expert's gate, up and down bytes as the gguf package reads them from the file, zero-padded to the row."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    parts = [np.asarray(tensors[f"blk.{layer}.ffn_{p}_exps.weight"].data) for p in ("gate", "up", "down")]
    return [b"".join(p[e].tobytes() for p in parts).ljust(row_bytes, b"\0") for e in experts]


@pytest.mark.parametrize(("size", "expert_dtype"), [("tiny-k", "mixed"), ("tiny-k", "q4_k_m"), ("tiny", "f32")])
def test_rows_equal_the_store_and_the_file(tmp_path_factory, tmp_path: Path, size: str, expert_dtype: str) -> None:
    path = gguf_file(tmp_path_factory, size, expert_dtype)
    in_place = LLM(str(path), **ENGINE, **OFFLOAD, ram_budget="0.5").engine.expert_cache.tier
    stored = LLM(str(path), **ENGINE, **OFFLOAD, ram_budget="0.5", expert_store=str(tmp_path)).engine.expert_cache.tier
    assert not isinstance(stored.source, InPlaceExperts) and len(list(tmp_path.glob("edgemoe-experts-*.bin"))) == 1
    assert (in_place.row_bytes, in_place.stride) == (stored.row_bytes, stored.stride)
    for layer in range(in_place.layers):
        experts = [0, in_place.experts - 1, 1][: in_place.rows]
        got = fetched(in_place, layer, experts)
        assert got == fetched(stored, layer, experts), layer
        assert got == file_rows(path, layer, experts, in_place.row_bytes), layer
    few = RamTier(in_place.source, 3, pin=False)  # rows reused by other layers' experts (other formats: padding)
    for layer in [*range(few.layers), *reversed(range(few.layers))]:
        assert fetched(few, layer, [2, 0, 3]) == file_rows(path, layer, [2, 0, 3], few.row_bytes), layer


def fetched(tier: RamTier, layer: int, experts: list[int]) -> list[bytes]:
    """The rows `tier` serves for `experts` of `layer`."""
    return [tier.pool[r, : tier.row_bytes].numpy().tobytes() for r in tier.fetch(layer, torch.tensor(experts))]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> a tiny checkpoint of transformers' classes as llama.cpp's converter writes it: Qwen3-MoE in Q8_0,
    gpt-oss in F32 (its converter's float experts), each alone in its folder."""
    from tests.conftest import hf_model, save_checkpoint
    from tests.models.llama_converter import convert
    from tests.models.test_llama_converter import CASES as CONVERTED

    def get(family: str, outtype: str) -> Path:
        model = hf_model(family, **CONVERTED[family][1])
        folder = save_checkpoint(model, tmp_path_factory.mktemp(f"{family}-hf"), "per-expert")
        out = tmp_path_factory.mktemp(f"{family}-gguf") / f"{family}-{outtype}.gguf"
        return convert(folder, out, outtype=outtype)

    return get


@pytest.mark.parametrize(("family", "outtype"), [("qwen3_moe", "q8_0"), ("gpt_oss", "f32")])
def test_gguf_from_llama_cpp_read_in_place(converted, cache_dir: Path, family: str, outtype: str) -> None:
    path = converted(family, outtype)
    want = tokens(LLM(str(path), **ENGINE))
    llm = LLM(str(path), **ENGINE, **OFFLOAD, ram_budget="0.25")
    assert tokens(llm) == want
    assert_in_place(llm, path, cache_dir)


def test_a_gguf_changed_under_a_running_engine_fails_the_step(tmp_path: Path, cache_dir: Path) -> None:
    for change in ("touched", "truncated"):
        path = make_model(tmp_path / change, "qwen3_moe", "tiny", dtype="float32", format="gguf", expert_dtype="q8_0")
        llm = LLM(str(path), **ENGINE, **OFFLOAD, ram_budget="0.17")
        assert_in_place(llm, path, cache_dir, ran=False)
        if change == "touched":
            stat = path.stat()
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        else:
            os.truncate(path, path.stat().st_size // 2)
        with pytest.raises(EdgeMoEError, match="the RAM tier of the experts failed: model.gguf changed on disk since "
                                               "it was opened") as info:  # fmt: skip
            tokens(llm)
        assert "\n" not in str(info.value)


def test_experts_converted_on_load_go_to_the_store(tmp_path_factory, cache_dir: Path) -> None:
    """BF16 experts under a float32 engine are converted as they load: the store holds them, as before (in the
    checkpoint's folder, else the cache folder)."""
    path = make_model(tmp_path_factory.mktemp("bf16"), "qwen3_moe", "tiny", dtype="float32", format="gguf",
                      expert_dtype="bf16")  # fmt: skip
    want = tokens(LLM(str(path), **ENGINE))
    llm = LLM(str(path), **ENGINE, **OFFLOAD, ram_budget="0.17")
    assert tokens(llm) == want
    tier = llm.engine.expert_cache.tier
    assert not isinstance(tier.source, InPlaceExperts) and tier.source.path.parent == path.parent
    assert f"all on disk (expert store {tier.source.path})" in startup_line(llm.engine)


# ----------------------------------------------------------------------------------- the reader, over segments

MiB = 2**20


class Pieces:
    """A `TierSource` over a table given here: `layers` x `experts` rows of `row_bytes`, each gathered from `files`
    by `table` [(file, offset, bytes, at), ...] a row."""

    name, where = "the pieces", "in pieces"

    def __init__(self, files: list[Path], table: list[list[tuple[int, int, int, int]]], layers: int, row_bytes: int):
        self.files, self.table, self.layers = files, table, layers
        self.experts, self.row_bytes = len(table) // layers, row_bytes
        self.stride = -(-row_bytes // 4096) * 4096

    def segments(self) -> torch.Tensor:
        return torch.tensor(self.table, dtype=torch.int64)

    def expected(self, key: int) -> bytes:
        row = bytearray(self.row_bytes)
        data = [f.read_bytes() for f in self.files]
        for file, offset, size, at in self.table[key]:
            row[at : at + size] = bytes(size) if file < 0 else data[file][offset : offset + size]
        return bytes(row)


def test_the_reader_gathers_unaligned_pieces_from_several_files(tmp_path: Path) -> None:
    gen = np.random.default_rng(3)
    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    big.write_bytes(gen.integers(0, 256, 11 * MiB, dtype=np.uint8).tobytes())
    small.write_bytes(gen.integers(0, 256, 10_000, dtype=np.uint8).tobytes())  # ends off a 4 KiB boundary
    head = 4 * MiB + 4096 + 13  # longer than the reader's bounce buffer (4 MiB): read in pieces
    row_bytes = head + 777 + 100 + 8192
    table = []
    for key in range(6):
        table.append([
            (0, 4097 * key + 13, head, 0),  # unaligned offset and length
            (1, 10_000 - 777 - 5 * key, 777, head),  # key 0: up to the end of the file
            (-1, 0, 100, head + 777),  # zeros
            (0, 8192 * (key + 1), 8192, row_bytes - 8192),  # aligned offset and length, unaligned place in the row
        ])  # fmt: skip
    source = Pieces([big, small], table, 2, row_bytes)
    tier = RamTier(source, 4, pin=False)
    for layer, experts in ((0, [0, 2]), (1, [1]), (1, [0, 2, 1])):  # several reads at once, then one alone
        rows = tier.fetch(layer, torch.tensor(experts))
        for e, r in zip(experts, rows.tolist()):
            key = layer * 3 + e
            assert tier.pool[r, :row_bytes].numpy().tobytes() == source.expected(key), key

    table[5][1] = (1, 10_000 - 100, 777, head)  # past the end of the file: a short read
    bad = RamTier(Pieces([big, small], table, 2, row_bytes), 2, pin=False)
    with pytest.raises(EdgeMoEError, match="a read of the pieces failed or came back short"):
        bad.fetch(1, torch.tensor([2]))
    assert bad.row_of(1, 2) == -1
