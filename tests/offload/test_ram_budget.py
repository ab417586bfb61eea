"""`--ram-budget` end to end on the CPU (`edgemoe.LLM`, and the CLI for its errors): offloaded experts of which only
a budget's worth stay in RAM rows, the rest read from an expert store on disk that the loader writes once.

Checked against resident experts of the same checkpoint, token for token (greedy): tiny qwen2_moe and qwen3_moe
checkpoints (make-model, float32) at budgets given as fractions (half the experts; the fewest a decode step of the
batch allows) and as bytes, with the RAM tier's counters showing it read from disk and served exactly the device
cache's misses; experts quantized on load (q8_0, q4_0); a GGUF of Q8_0 experts written by llama.cpp's own converter
(tests/models/llama_converter.py), its blocks kept as stored in the store. The store: reused by a second engine (same
file, not rewritten) whatever the budget, written anew once the checkpoint's file changes or the experts' format
does; a budget that holds every expert is plain offload (no tier, no store). Errors, one line each from `LLM` and
from the CLI: a budget without offload, an unreadable one, one above the memory available, one below a decode step's
experts, a CPU split beside it, a store folder without a budget; a store truncated under a running engine fails the
step naming the RAM tier; a load interrupted once the store's file exists leaves no file behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from edgemoe import LLM, EdgeMoEError, SamplingParams
from edgemoe.cli import main
from edgemoe.offload import banks
from edgemoe.offload.expert_store import HEADER_BYTES, MAGIC
from edgemoe.offload.layout import ExpertLayout, QuantExpertLayout
from edgemoe.tools.make_model import make_model

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
ENGINE = dict(max_num_seqs=2, max_model_len=256, progress=False)
OFFLOAD = dict(moe_strategy="offload", moe_cache_slots=4)  # 4: the fewest slots, max_num_seqs 2 x top-2
EXPERTS, TOP_K, HIDDEN, INTER = 3 * 8, 2, 64, 32  # make-model's tiny: 3 MoE layers of 8 experts


def prompts() -> list[list[list[int]]]:
    """Two batches: a 13-token and a 5-token prompt prefilled together (several waves of experts), then one more."""
    g = torch.Generator().manual_seed(21)
    return [[torch.randint(3, 6000, (n,), generator=g).tolist() for n in ns] for ns in ((13, 5), (4,))]


def tokens(llm: LLM) -> list[list[list[int]]]:
    return [[o.token_ids for o in llm.generate(batch, GREEDY)] for batch in prompts()]


def stride(row_bytes: int) -> int:
    """A store row's bytes: the expert's rounded up to 4 KiB."""
    return -(-row_bytes // 4096) * 4096


def store_files(folder: Path) -> list[Path]:
    return sorted(folder.iterdir()) if folder.exists() else []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (folder of a tiny random float32 checkpoint, its resident greedy tokens); made once each."""
    cache: dict = {}

    def get(family: str, layout: str = "fused") -> tuple[str, list]:
        if (family, layout) not in cache:
            folder = str(make_model(tmp_path_factory.mktemp(family), family, "tiny", layout=layout, dtype="float32"))
            want = tokens(LLM(folder, **ENGINE))
            assert len({t for batch in want for ids in batch for t in ids}) > 5, "degenerate model"
            cache[family, layout] = folder, want
        return cache[family, layout]

    return get


@pytest.mark.parametrize(("family", "layout"), [("qwen2_moe", "fused"), ("qwen3_moe", "per-expert")])
def test_greedy_identical_to_resident_experts(tiny, tmp_path: Path, family: str, layout: str) -> None:
    folder, want = tiny(family, layout)
    row = stride(ExpertLayout(HIDDEN, INTER, torch.float32).row_bytes)
    # (budget, RAM rows, device slots): 4 rows, max_num_seqs 2 x top-2, the fewest; more slots than rows: prefill's
    # waves as long as the rows
    cases = [("0.5", EXPERTS // 2, 4), ("0.17", 4, 4), (f"{6 * row // 1024}KiB", 6, 4), ("0.17", 4, 9)]
    for budget, rows, slots in cases:
        store = tmp_path / f"{budget}-{slots}"
        llm = LLM(folder, **ENGINE, moe_strategy="offload", moe_cache_slots=slots, ram_budget=budget,
                  expert_store=str(store), moe_collect_stats=True)  # fmt: skip
        assert tokens(llm) == want, budget
        stats = llm.engine.moe_stats()
        tier = stats["ram_tier"]
        assert tier["rows"] == rows and tier["error"] == 0, budget
        assert tier["reads"] > 0 and tier["bytes_read"] == tier["reads"] * row, budget  # the disk path ran
        assert tier["accesses"] == stats["total"]["misses"] > 0, budget  # each miss of the device cache, once
        assert tier["reads"] == tier["accesses"] - tier["hits"], budget
        if rows > slots:
            assert tier["hits"] > 0, budget  # rows beyond the device's slots serve some misses from RAM
        (file,) = store_files(store)
        assert file.name.startswith("edgemoe-experts-") and file.suffix == ".bin"
        assert file.stat().st_size == HEADER_BYTES + EXPERTS * row


@pytest.mark.parametrize("expert_dtype", ["q8_0", "q4_0"])
def test_quantized_experts_identical_to_resident(tiny, tmp_path: Path, expert_dtype: str) -> None:
    folder, _ = tiny("qwen2_moe")
    want = tokens(LLM(folder, **ENGINE, expert_dtype=expert_dtype))
    layout = QuantExpertLayout(HIDDEN, INTER, expert_dtype, expert_dtype, torch.float32)
    row = stride(layout.row_bytes)
    for budget, rows in {"0.25": 6, f"{5 * row // 1024}KiB": 5}.items():  # bytes: of the quantized rows
        store = tmp_path / budget
        llm = LLM(folder, **ENGINE, **OFFLOAD, expert_dtype=expert_dtype, ram_budget=budget, expert_store=str(store),
                  moe_collect_stats=True)  # fmt: skip
        assert tokens(llm) == want, budget
        tier = llm.engine.moe_stats()["ram_tier"]
        assert tier["rows"] == rows and tier["reads"] > 0 and tier["bytes_read"] == tier["reads"] * layout.row_bytes
        (file,) = store_files(store)
        assert file.stat().st_size == HEADER_BYTES + EXPERTS * row


@pytest.fixture(scope="module")
def converted_gguf(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE checkpoint (transformers' classes) as llama.cpp's converter writes it with Q8_0 weights."""
    pytest.importorskip("gguf")
    from tests.conftest import hf_model, save_checkpoint
    from tests.models.llama_converter import convert
    from tests.models.test_llama_converter import CASES

    model = hf_model("qwen3_moe", **CASES["qwen3_moe"][1])
    folder = save_checkpoint(model, tmp_path_factory.mktemp("qwen3_moe-hf"), "per-expert")
    return convert(folder, folder.parent / "qwen3_moe-q8_0.gguf", outtype="q8_0")


def test_gguf_from_llama_cpp_identical_to_resident(converted_gguf: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    path = str(converted_gguf)
    engine = dict(ENGINE, dtype="float32")
    want = tokens(LLM(path, **engine))
    llm = LLM(path, **engine, **OFFLOAD, ram_budget="0.25", expert_store=str(tmp_path), moe_collect_stats=True)
    assert tokens(llm) == want
    tier = llm.engine.moe_stats()["ram_tier"]
    assert tier["rows"] == 6 and tier["reads"] > 0
    (file,) = store_files(tmp_path)
    head = file.read_bytes()[:HEADER_BYTES]
    formats = json.loads(head[len(MAGIC) :].rstrip(b" "))["formats"]
    assert len(formats) == 3 and all(f.startswith("Q8_0/Q8_0:") for f in formats)  # the file's blocks, as stored

    # a GGUF whose load fails once its experts are in the store's temporary file leaves no file
    from edgemoe.models import loader

    def incomplete(*args, **kwargs) -> None:
        raise EdgeMoEError("the checkpoint lacks a tensor")

    monkeypatch.setattr(loader, "_check_filled", incomplete)
    other = tmp_path / "failed"
    with pytest.raises(EdgeMoEError, match="lacks a tensor"):
        LLM(path, **engine, **OFFLOAD, ram_budget="0.25", expert_store=str(other))
    assert store_files(other) == []


def test_the_store_is_reused_until_the_checkpoint_changes(tmp_path: Path) -> None:
    folder = make_model(tmp_path / "model", "qwen3_moe", "tiny", layout="fused", dtype="float32")
    want = tokens(LLM(str(folder), **ENGINE))
    store = tmp_path / "store"
    kwargs = dict(ENGINE, **OFFLOAD, expert_store=str(store), moe_collect_stats=True)
    assert tokens(LLM(str(folder), **kwargs, ram_budget="0.5")) == want
    (first,) = store_files(store)
    stamp = first.stat()
    for budget in ("0.5", "0.25"):  # one store serves every budget
        llm = LLM(str(folder), **kwargs, ram_budget=budget)
        assert store_files(store) == [first]
        now = first.stat()
        assert (now.st_mtime_ns, now.st_ino) == (stamp.st_mtime_ns, stamp.st_ino)  # not written again
        assert tokens(llm) == want and llm.engine.moe_stats()["ram_tier"]["reads"] > 0

    (weights,) = Path(folder).glob("*.safetensors")
    old = weights.stat()
    os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns + 10**9))  # the same bytes, but the file changed
    assert tokens(LLM(str(folder), **kwargs, ram_budget="0.5")) == want
    files = store_files(store)
    assert len(files) == 2 and first in files

    LLM(str(folder), **kwargs, ram_budget="0.5", expert_dtype="q8_0")
    assert len(store_files(store)) == 3  # experts in another format: another store


def test_a_budget_for_every_expert_is_plain_offload(tiny, tmp_path: Path) -> None:
    folder, want = tiny("qwen2_moe")
    row = stride(ExpertLayout(HIDDEN, INTER, torch.float32).row_bytes)
    for budget in ("0.99", f"{EXPERTS * row}", "1GiB"):
        llm = LLM(folder, **ENGINE, **OFFLOAD, ram_budget=budget, expert_store=str(tmp_path), moe_collect_stats=True)
        assert tokens(llm) == want, budget
        assert "ram_tier" not in llm.engine.moe_stats(), budget
        assert llm.engine.expert_cache.tier is None
        assert store_files(tmp_path) == [], budget


def test_a_store_truncated_under_a_running_engine_fails_the_step(tiny, tmp_path: Path) -> None:
    folder, _ = tiny("qwen2_moe")
    llm = LLM(folder, **ENGINE, **OFFLOAD, ram_budget="0.17", expert_store=str(tmp_path))
    (file,) = store_files(tmp_path)
    os.truncate(file, file.stat().st_size // 2)
    with pytest.raises(EdgeMoEError, match="the RAM tier of the experts failed: the expert store changed") as info:
        tokens(llm)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------------ errors

ERRORS = [  # (id, LLM keyword arguments beyond the model's, a fragment of the one line)
    ("resident", dict(ram_budget="0.5"), "ram_budget keeps some experts on disk: it needs moe_strategy offload"),
    ("abc", dict(OFFLOAD, ram_budget="abc"), "cannot read ram_budget 'abc'"),
    ("zero", dict(OFFLOAD, ram_budget="0"), "cannot read ram_budget '0'"),
    ("above-one", dict(OFFLOAD, ram_budget="1.5"), "cannot read ram_budget '1.5'"),
    ("below-top-k", dict(OFFLOAD, ram_budget="0.05"), "holds 1 experts"),
    ("below-a-step", dict(OFFLOAD, ram_budget="0.125"), "MiB each); a decode step of 2 sequences needs up to 4"),
    ("bytes-below-top-k", dict(OFFLOAD, ram_budget="24KiB"), "holds 1 experts"),
    ("cpu-split", dict(OFFLOAD, ram_budget="0.5", moe_cpu_compute="2"), "with ram_budget use off"),
    ("store-alone", dict(OFFLOAD, expert_store="somewhere"), "expert_store is where experts beyond ram_budget go"),
]


@pytest.mark.parametrize(("kwargs", "fragment"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_settings_are_one_line(tiny, tmp_path: Path, kwargs: dict, fragment: str) -> None:
    folder, _ = tiny("qwen2_moe")
    store = {"expert_store": str(tmp_path / "store")} if "ram_budget" in kwargs else {}
    with pytest.raises(EdgeMoEError) as info:
        LLM(folder, **ENGINE, **store, **kwargs)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.bin"))  # refused before any store


def test_a_budget_above_the_memory_available_is_one_line(tiny, tmp_path: Path, monkeypatch) -> None:
    folder, _ = tiny("qwen2_moe")
    row = stride(ExpertLayout(HIDDEN, INTER, torch.float32).row_bytes)
    monkeypatch.setattr(banks, "available_memory", lambda: 5 * row)
    LLM(folder, **ENGINE, **OFFLOAD, ram_budget="0.2", expert_store=str(tmp_path))  # 5 rows: fits
    for budget in ("0.5", f"{6 * row}"):
        with pytest.raises(EdgeMoEError, match=r"ram_budget \S+ is 0\.0 GiB of experts; this machine has 0\.0 GiB "
                                               "available") as info:  # fmt: skip
            LLM(folder, **ENGINE, **OFFLOAD, ram_budget=budget, expert_store=str(tmp_path / budget))
        assert "\n" not in str(info.value)
        assert store_files(tmp_path / budget) == []  # refused before any store is made


CLI_ERRORS = [  # (id, flags, a fragment of the one line, whether it comes after the line saying what loads)
    ("resident", ["--ram-budget", "0.5"], "it needs moe_strategy offload", False),
    ("abc", ["--moe-strategy", "offload", "--ram-budget", "abc"], "cannot read ram_budget 'abc'", False),
    ("above-one", ["--moe-strategy", "offload", "--ram-budget", "1.5"], "cannot read ram_budget '1.5'", False),
    ("below-top-k", ["--moe-strategy", "offload", "--ram-budget", "0.05"], "needs up to 2 of one layer", True),
    ("cpu-split", ["--moe-strategy", "offload", "--ram-budget", "0.5", "--moe-cpu-compute", "2"], "use off", False),
    ("store-alone", ["--moe-strategy", "offload", "--expert-store", "x"], "give ram_budget too", False),
]


@pytest.mark.parametrize(("flags", "fragment", "loading"), [e[1:] for e in CLI_ERRORS], ids=[e[0] for e in CLI_ERRORS])
def test_cli_errors_are_one_line(tiny, tmp_path: Path, capsys, flags: list[str], fragment: str, loading: bool) -> None:
    folder, _ = tiny("qwen2_moe")
    store = ["--expert-store", str(tmp_path)] if "--ram-budget" in flags else []
    argv = ["generate", "--model", folder, "--moe-cache-slots", "4", *flags, *store, "--max-tokens", "2", "hello"]
    if "--moe-strategy" not in flags:  # resident: no cache to size
        argv = [a for a in argv if a not in ("--moe-cache-slots", "4")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err
    if loading:
        assert lines.pop(0).startswith("edgemoe: loading "), err
    assert len(lines) == 1 and lines[0].startswith("edgemoe: error: ") and fragment in lines[0], err


@pytest.mark.parametrize("where", ["load_weights", "place_ple"])
def test_an_interrupted_load_leaves_no_store(tiny, tmp_path: Path, monkeypatch, where: str) -> None:
    """Interrupted while the loader fills the store (after the real `load_weights` wrote every expert), and before
    it starts (the store's file already made): neither the store nor its temporary file stays."""
    from edgemoe.models import loader

    folder, want = tiny("qwen2_moe")
    original = getattr(loader, where)
    during: list[list[Path]] = []

    def interrupted(*args, **kwargs) -> None:
        original(*args, **kwargs)
        during.append(store_files(tmp_path))
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        LLM(folder, **ENGINE, **OFFLOAD, ram_budget="0.5", expert_store=str(tmp_path))
    ((tmp,),) = during
    assert tmp.name.endswith(".tmp")  # the store was under way
    assert store_files(tmp_path) == []
    monkeypatch.undo()
    llm = LLM(folder, **ENGINE, **OFFLOAD, ram_budget="0.5", expert_store=str(tmp_path))
    assert tokens(llm) == want and len(store_files(tmp_path)) == 1  # written whole the next time
