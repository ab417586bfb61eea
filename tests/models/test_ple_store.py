"""PLE backends through the engine (float32, CPU, tiny Gemma-4 checkpoints): `host` and `disk` (host and wait sync)
greedy tokens identical to `gpu` and to transformers, prompts with repeated tokens batched, prefill chunked; the disk
table mapped in place from the checkpoint where it is stored in the run's dtype, else converted once into a file
beside it (or in the cache directory) and reused unchanged; no table-sized tensor is held; every bad input is one
line naming what is wrong; the runner hands each step's ids to the pre-step hook."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from edgemoe import LLM, EdgeMoEError, SamplingParams, demo_model_path
from edgemoe.layers.ple_disk import DiskPerLayerEmbeddings
from edgemoe.models import ple_store
from tests.models.test_gemma4 import CASES, gemma_model, save
from tests.models.test_hf_parity import hf_greedy, prompts

KEY = "model.embed_tokens_per_layer.weight"
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ple_checkpoint(tmp_path_factory):
    """(transformers model, float32 checkpoint, bfloat16 checkpoint of the same weights rounded)."""
    hf = gemma_model(**CASES["moe-ple-kvshared"])
    f32 = save(hf, tmp_path_factory.mktemp("f32"), "fused")
    bf16 = tmp_path_factory.mktemp("bf16")
    shutil.copytree(f32, bf16, dirs_exist_ok=True)
    state = load_file(str(f32 / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(bf16 / "model.safetensors"))
    return hf, f32, bf16


def batch() -> list[list[int]]:
    """Prompts of 10, 19 and 48 tokens that repeat tokens within and across prompts (a step's ids deduplicated),
    prefilled in chunks of 16."""
    a, b, c = prompts(11)
    return [a + a, b, c[:20] + a + c[20:]]


def generate(folder: Path, **engine) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(folder), progress=False, max_num_batched_tokens=16, **engine)
    return [o.token_ids for o in llm.generate(batch(), GREEDY)], llm


def ple_module(llm: LLM):
    return llm.engine.model.model.embed_tokens_per_layer


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(("backend", "sync"), [("host", "host"), ("disk", "host"), ("disk", "wait")])
def test_backends_match_gpu_and_transformers(ple_checkpoint, tmp_path: Path, backend: str, sync: str) -> None:
    hf, f32, _ = ple_checkpoint
    folder = copy_folder(f32, tmp_path / "ckpt")
    gpu, _ = generate(folder)
    assert gpu == [hf_greedy(hf, p) for p in batch()]
    outs, llm = generate(folder, ple_backend=backend, ple_sync=sync)
    assert outs == gpu
    assert (
        type(ple_module(llm)).__name__ == {"host": "HostPerLayerEmbeddings", "disk": "DiskPerLayerEmbeddings"}[backend]
    )


def test_disk_maps_the_checkpoint_in_place(ple_checkpoint, tmp_path: Path) -> None:
    _, f32, _ = ple_checkpoint
    folder = copy_folder(f32, tmp_path / "ckpt")
    outs, llm = generate(folder, ple_backend="disk")
    disk = ple_module(llm)
    assert isinstance(disk.table, np.memmap) and Path(disk.table.filename) == folder / "model.safetensors"
    assert not list(folder.glob("*.ple")), "a table stored in the run's dtype is not converted"
    held = [*llm.engine.model.parameters(), *llm.engine.model.buffers(), disk.staging, disk.slots]
    assert all(t.shape != disk.table.shape for t in held), "a table-sized tensor is held"
    assert disk.staging.shape == (16, disk.table.shape[1]), "staging: a prefill chunk's tokens"


def test_disk_converts_once_beside_the_checkpoint(ple_checkpoint, tmp_path: Path, monkeypatch) -> None:
    """A bfloat16 checkpoint run in float32: the table is written once, in float32, then reused as it is."""
    _, _, bf16 = ple_checkpoint
    folder = copy_folder(bf16, tmp_path / "ckpt")
    gpu, _ = generate(folder, dtype="float32")
    outs, llm = generate(folder, dtype="float32", ple_backend="disk")
    assert outs == gpu
    (written,) = folder.glob("*.ple")
    assert written.name == f"{KEY}.float32.ple" and Path(ple_module(llm).table.filename) == written
    before = os.stat(written)

    def no_rewrite(*args) -> None:
        raise AssertionError("the converted table was written again")

    monkeypatch.setattr(ple_store, "_write_rows", no_rewrite)
    again, _ = generate(folder, dtype="float32", ple_backend="disk")
    after = os.stat(written)
    assert again == gpu and (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_disk_converts_into_the_cache_where_the_folder_is_not_writable(ple_checkpoint, tmp_path, monkeypatch) -> None:
    _, _, bf16 = ple_checkpoint
    folder = copy_folder(bf16, tmp_path / "ckpt")
    monkeypatch.setattr(ple_store, "CACHE_DIR", tmp_path / "cache")
    blocked = folder / f"{KEY}.float32.ple.{os.getpid()}.tmp"
    blocked.mkdir()  # the temporary file cannot be made beside the checkpoint (as in a read-only folder, even as root)
    outs, llm = generate(folder, dtype="float32", ple_backend="disk")
    (written,) = (tmp_path / "cache").glob(f"*/{KEY}.float32.ple")
    assert Path(ple_module(llm).table.filename) == written and not list(folder.glob("*.ple"))
    assert outs == generate(folder, dtype="float32")[0]


def converted(ple_checkpoint, tmp_path: Path) -> tuple[Path, Path]:
    """A bfloat16 checkpoint whose float32 table has been written (folder, table file)."""
    folder = copy_folder(ple_checkpoint[2], tmp_path / "ckpt")
    LLM(str(folder), progress=False, dtype="float32", ple_backend="disk")
    return folder, folder / f"{KEY}.float32.ple"


def one_line_error(folder: Path, **engine) -> str:
    with pytest.raises(EdgeMoEError) as err:
        LLM(str(folder), progress=False, **engine)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_short_converted_table_is_one_line_naming_it(ple_checkpoint, tmp_path: Path) -> None:
    folder, table = converted(ple_checkpoint, tmp_path)
    os.truncate(table, table.stat().st_size - 4)
    message = one_line_error(folder, dtype="float32", ple_backend="disk")
    assert str(table) in message and " is short: " in message and "delete it" in message


@pytest.mark.parametrize("edit", ["vocab", "not ours"])
def test_a_mismatched_converted_table_is_one_line_naming_it(ple_checkpoint, tmp_path: Path, edit: str) -> None:
    folder, table = converted(ple_checkpoint, tmp_path)
    data = bytearray(table.read_bytes())
    if edit == "vocab":
        header = json.loads(data[len(ple_store.MAGIC) : ple_store.HEADER_BYTES])
        text = ple_store.MAGIC + json.dumps(header | {"vocab": header["vocab"] + 1}).encode()
        data[: ple_store.HEADER_BYTES] = text.ljust(ple_store.HEADER_BYTES, b" ")
    else:
        data[:4] = b"junk"
    table.write_bytes(bytes(data))
    message = one_line_error(folder, dtype="float32", ple_backend="disk")
    assert str(table) in message
    if edit == "vocab":
        assert "holds vocab 6145," in message and "this model needs vocab 6144," in message
    else:
        assert "is not a per-layer embedding table edgemoe wrote" in message


def test_a_short_checkpoint_is_one_line_naming_it(ple_checkpoint, tmp_path: Path) -> None:
    folder = copy_folder(ple_checkpoint[1], tmp_path / "ckpt")
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    message = one_line_error(folder, ple_backend="disk")
    assert f"cannot read {weights}" in message


def test_a_checkpoint_without_the_table_is_one_line_naming_it(ple_checkpoint, tmp_path: Path) -> None:
    folder = copy_folder(ple_checkpoint[1], tmp_path / "ckpt")
    state = load_file(str(folder / "model.safetensors"))
    del state[KEY]
    save_file(state, str(folder / "model.safetensors"))
    assert one_line_error(folder, ple_backend="disk") == f"checkpoint {folder} lacks {KEY}"


@pytest.mark.parametrize("backend", ["host", "disk"])
def test_ple_backend_on_a_family_without_ple_is_one_line(backend: str) -> None:
    message = one_line_error(demo_model_path(), ple_backend=backend)
    assert message == f"ple_backend {backend}: qwen2_moe models have no per-layer embeddings"


def test_wait_sync_needs_the_disk_backend() -> None:
    assert "use it with ple_backend disk, not host" in one_line_error(demo_model_path(), ple_backend="host",
                                                                     ple_sync="wait")  # fmt: skip


def test_the_runner_hands_every_step_its_ids(ple_checkpoint, tmp_path: Path, monkeypatch) -> None:
    """The pre-step hook sees each prefill chunk's and each decode batch's token ids, in order, before the step; the
    disk backend reads each step's distinct ids once."""
    calls: list[list[int]] = []
    original = DiskPerLayerEmbeddings.before_step
    monkeypatch.setattr(DiskPerLayerEmbeddings, "before_step", lambda self, ids: (calls.append(list(ids)),
                                                                                   original(self, ids))[1])  # fmt: skip
    folder = copy_folder(ple_checkpoint[1], tmp_path / "ckpt")
    llm = LLM(str(folder), progress=False, dtype="float32", max_num_batched_tokens=16, ple_backend="disk")
    prompt = batch()[0] * 3  # 30 tokens, 5 distinct: chunks of 16 and 14
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids
    assert calls == [prompt[:16], prompt[16:], *[[t] for t in out[:-1]]]
    read = ple_module(llm).rows_read
    assert read == sum(len(set(ids)) for ids in calls) and read < sum(map(len, calls))
