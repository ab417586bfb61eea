"""llama.cpp's own Hugging Face -> GGUF converter (`convert_hf_to_gguf.py`), the tests' independent writer of GGUF
files: taken from the llama-cpp-python sdist on PyPI (`vendor/llama.cpp/`), downloaded once per machine with
`pip download` and cached, then run as a subprocess on its own vendored `gguf-py`.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

VERSION = "0.3.36"  # llama-cpp-python's; its vendor/llama.cpp is the converter tested against
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # the converter, its model classes, its gguf package

# The subprocess: llama.cpp's converter with one method replaced. A byte-level BPE tokenizer is accepted only if a hash
# of how it encodes a fixed text is on the converter's list of known models; the tests' checkpoints carry edgemoe's
# demo tokenizer, which is on no list, so `get_vocab_base_pre` names its pre-tokenizer instead of hashing it.
# argv: the converter's folder, the pre-tokenizer's name, the converter's own arguments.
_RUN = """
import runpy, sys
folder, pre, *args = sys.argv[1:]
import gguf
assert gguf.__file__.startswith(folder), f"not the converter's own gguf-py: {gguf.__file__}"
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [f"{folder}/convert_hf_to_gguf.py", *args]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


_failed: list[str] = []  # why the download failed, once it has


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgemoe" / "llama-converter" / VERSION


def converter() -> Path:
    """The folder holding `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/`: the cache, filled on first use from
    the sdist (`pip download`, then deleted); pytest.skip when neither the cache nor the download can be had."""
    folder = cache_dir()
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # test processes started together download once
        if not folder.is_dir():
            with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
                tree = Path(tmp) / "tree"
                _extract(_download(Path(tmp)), tree)
                tree.rename(folder)  # whole or absent: a folder in the cache is a complete one
    return folder


def _download(into: Path) -> Path:
    spec = f"llama-cpp-python=={VERSION}"
    if _failed:  # once a session: without a network every test would wait for pip's timeouts again
        pytest.skip(_failed[0])
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec, "-d", str(into)]
    try:
        proc = subprocess.run([*cmd, "--retries", "2", "--timeout", "30"], capture_output=True, text=True, timeout=600)
        error = (proc.stderr.strip().splitlines() or ["no output"])[-1] if proc.returncode else None
    except (OSError, subprocess.TimeoutExpired) as exc:
        error = str(exc)
    sdists = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    error = error or (None if sdists else f"no sdist in {into}")
    if error:
        _failed.append(f"llama.cpp's converter is not in {cache_dir()} and `pip download {spec}` failed: {error}")
        pytest.skip(_failed[0])
    return sdists[0]


def _extract(sdist: Path, into: Path) -> None:
    """The converter's files of `sdist`, without their `llama_cpp_python-X/vendor/llama.cpp/` prefix, into `into`."""
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        for member in tar:
            rel = member.name.removeprefix(prefix)
            if rel == member.name or not member.isfile() or not rel.startswith(_KEEP) or ".." in rel.split("/"):
                continue
            out = into / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(member).read())
    if not (into / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"{sdist.name} holds no {prefix}convert_hf_to_gguf.py")


def convert(folder: Path, out: Path, outtype: str = "f32", pre: str = "gpt-2", options: tuple[str, ...] = ()) -> Path:
    """`folder`'s Hugging Face checkpoint converted by llama.cpp's converter to `out` (`outtype`: f32, f16, bf16,
    q8_0), its byte-level BPE tokenizer written with pre-tokenizer `pre` (see `_RUN`), with the converter's further
    command-line `options`."""
    tool = converter()
    path = [str(tool / "gguf-py"), str(tool), os.environ.get("PYTHONPATH", "")]  # its own gguf before any installed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    args = [str(tool), pre, str(folder), "--outfile", str(out), "--outtype", outtype, *options]
    proc = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode:
        raise AssertionError(f"llama.cpp's converter failed on {folder}:\n{proc.stderr[-4000:]}")
    return out
