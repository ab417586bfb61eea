"""The CLI as a user meets it: streaming output, --version, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgemoe import SamplingParams, demo_model_path


def edgemoe(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edgemoe", *args], capture_output=True, text=True, input=stdin, timeout=300
    )


def assert_user_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgemoe: error:") and fragment in lines[0], proc.stderr


def test_version_and_help() -> None:
    from edgemoe import __version__

    assert edgemoe("--version").stdout.strip() == f"edgemoe {__version__}"
    for cmd in ("generate", "make-model"):
        proc = edgemoe(cmd, "--help")
        assert proc.returncode == 0 and "usage:" in proc.stdout


def test_generate_streams_the_greedy_text(demo_llm) -> None:
    expected = demo_llm.generate("ROMEO.\n", SamplingParams(max_tokens=30, temperature=0))[0].text
    proc = edgemoe("generate", "ROMEO.\n", "--temperature", "0", "--max-tokens", "30")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"
    assert "tok/s" in proc.stderr
    piped = edgemoe("generate", "--temperature", "0", "--max-tokens", "30", stdin="ROMEO.\n")
    assert piped.stdout == proc.stdout


def test_chat_and_seed() -> None:
    a = edgemoe("generate", "--chat", "Good morrow!", "--seed", "3", "--max-tokens", "20")
    b = edgemoe("generate", "--chat", "Good morrow!", "--seed", "3", "--max-tokens", "20")
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout.strip()


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("broken")
    demo = demo_model_path()
    out = {}
    for name in ("malformed", "unsupported", "missing-tensor", "no-weights"):
        shutil.copytree(demo, root / name)
        out[name] = root / name
    (out["malformed"] / "config.json").write_text("{not json")
    cfg = json.loads((demo / "config.json").read_text())
    (out["unsupported"] / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(demo / "model.safetensors"))
    tensors.pop("model.layers.3.mlp.experts.5.up_proj.weight")
    save_file(tensors, str(out["missing-tensor"] / "model.safetensors"))
    (out["no-weights"] / "model.safetensors").unlink()
    return out


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("missing", "does not exist"),
        ("malformed", "malformed"),
        ("unsupported", "supported: mixtral, olmoe"),
        ("missing-tensor", "lacks 1 tensors, e.g. model.layers.3.mlp.experts.gate_up_proj"),
        ("no-weights", "no *.safetensors"),
    ],
)
def test_bad_models(broken_models, tmp_path, case, fragment) -> None:
    path = broken_models.get(case, tmp_path / "nope")
    assert_user_error(edgemoe("generate", "hi", "--model", str(path)), fragment)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--dtype", "float16"], "float16 is not supported on the cpu"),
        (["--dtype", "int3"], "unknown dtype"),
        (["--device", "cuda"] if not __import__("torch").cuda.is_available() else ["--device", "tpu"], "device"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--kv-cache-memory", "lots"], "cannot read size"),
        (["--graph-upload", "sometimes"], "unknown graph_upload 'sometimes'"),
    ],
)
def test_bad_flags(args, fragment) -> None:
    assert_user_error(edgemoe("generate", "hi", *args), fragment)


def test_empty_prompt() -> None:
    assert_user_error(edgemoe("generate", stdin=""), "no prompt")


def test_make_model_round_trip(tmp_path) -> None:
    out = tmp_path / "m"
    proc = edgemoe("make-model", str(out), "--family", "qwen3_moe", "--size", "tiny", "--layout", "fused")
    assert proc.returncode == 0, proc.stderr
    assert edgemoe("generate", "hi", "--model", str(out), "--max-tokens", "4").returncode == 0
    assert_user_error(edgemoe("make-model", str(tmp_path / "x"), "--family", "gpt2"), "unknown family")
    assert_user_error(edgemoe("make-model", str(tmp_path / "x"), "--size", "huge"), "unknown size")
