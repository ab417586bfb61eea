"""The CLI as a user meets it: streaming output, --version, and one-line errors (exit 2; no traceback) for every bad
input a new user meets first: flags, models, prompts, chat templates, a closed pipe."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgemoe import SamplingParams, demo_model_path


def edgemoe(*args: str | bytes, stdin: str | bytes | None = None) -> subprocess.CompletedProcess:
    """`python -m edgemoe ARGS`; bytes arguments or stdin go through as bytes (text that is not UTF-8)."""
    raw = isinstance(stdin, bytes) or any(isinstance(a, bytes) for a in args)
    proc = subprocess.run(
        [sys.executable, "-m", "edgemoe", *args], capture_output=True, text=not raw, input=stdin, timeout=300
    )
    if raw:
        proc.stdout, proc.stderr = proc.stdout.decode(), proc.stderr.decode()
    return proc


def assert_user_error(proc: subprocess.CompletedProcess, fragment: str, loading: bool = False) -> None:
    """Exit 2 and one error line; `loading`: after the line that says the model is loading (a model that passed the
    cheap checks, then failed to load). Flags, prompts and paths fail before it."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    if loading:
        assert re.fullmatch(r"edgemoe: loading .* \.\.\.", lines.pop(0)), proc.stderr
    assert len(lines) == 1 and lines[0].startswith("edgemoe: error:") and fragment in lines[0], proc.stderr


def test_version_and_help() -> None:
    from edgemoe import __version__

    assert edgemoe("--version").stdout.strip() == f"edgemoe {__version__}"
    for cmd in ("generate", "make-model"):
        proc = edgemoe(cmd, "--help")
        assert proc.returncode == 0 and "usage:" in proc.stdout


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["generate", "--help"], ["serve", "--help"],
                                  ["make-model", "--help"], ["bench", "--help"], ["cache-sim", "--help"]])  # fmt: skip
def test_version_and_help_do_not_import_torch(args: list[str]) -> None:
    """Importing torch takes ~2 s: a user who asks for the version or a command's flags must not wait for it."""
    code = f"""
import contextlib, io, sys
from edgemoe.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main({args!r})
    except SystemExit as exc:
        assert exc.code == 0, exc.code
assert out.getvalue().strip(), "nothing printed"
heavy = sorted(m for m in ("torch", "numpy", "transformers", "tokenizers", "safetensors") if m in sys.modules)
print(" ".join(heavy))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"{args} imported {proc.stdout.strip()}"


def subparsers() -> dict[str, argparse.ArgumentParser]:
    from edgemoe.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_no_flag_says_what_it_turns_off() -> None:
    """A --no-X flag's help says what the flag does (turn X off), not what X does when on."""
    seen = 0
    for name, parser in subparsers().items():
        for action in parser._actions:
            flag = next((o for o in action.option_strings if o.startswith("--no-")), None)
            if flag is not None:
                seen += 1
                assert action.help.startswith(("turn off", "skip")), f"{name} {flag}: {action.help}"
    assert seen >= 7  # generate's and serve's three each, bench's --no-warmup-prefill


def test_make_model_help_lists_every_size_and_family() -> None:
    from edgemoe.tools.presets import FAMILIES, PRESETS

    helps = {a.dest: a.help for a in subparsers()["make-model"]._actions}
    assert all(size in helps["size"] for size in PRESETS) and all(f in helps["family"] for f in FAMILIES)


def test_generate_streams_the_greedy_text(demo_llm) -> None:
    expected = demo_llm.generate("ROMEO.\n", SamplingParams(max_tokens=30, temperature=0))[0].text
    proc = edgemoe("generate", "ROMEO.\n", "--temperature", "0", "--max-tokens", "30", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"
    # time to first token (prefill) apart from the decode rate, which no longer divides by the prefill too
    assert re.search(r"prompt tokens, first token after \d+\.\d+ s; 30 tokens, then \d+\.\d tok/s decode", proc.stderr)
    # the KV cache holds this one sequence: the prompt's tokens + max_tokens, in whole blocks of 16
    prompt = len(demo_llm.tokenizer.encode("ROMEO.\n"))
    assert f"KV cache: {-(-(prompt + 30) // 16) * 16} tokens" in proc.stderr, proc.stderr
    piped = edgemoe("generate", "--temperature", "0", "--max-tokens", "30", "--dtype", "float32", stdin="ROMEO.\n")
    assert piped.stdout == proc.stdout


def test_chat_and_seed() -> None:
    a = edgemoe("generate", "--chat", "Good morrow!", "--seed", "3", "--max-tokens", "20")
    b = edgemoe("generate", "--chat", "Good morrow!", "--seed", "3", "--max-tokens", "20")
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout.strip()
    # what loads, then what runs where (float32: the demo model is under auto's bf16 threshold), before any text
    lines = a.stderr.splitlines()
    assert lines[0] == "edgemoe: loading the demo model ...", a.stderr
    assert any(
        re.fullmatch(r"edgemoe: the demo model \(qwen2_moe\) on cpu, float32 \(auto: [^)]*\): 12\.6 M parameters "
                     r"\(4\.4 M dense, 8\.3 M in experts\), all in RAM, "
                     r"context 2,048 tokens \(\d+ in the KV cache\), loaded in \d+\.\d s", line) for line in lines
    ), a.stderr  # fmt: skip
    help_text = " ".join(edgemoe("generate", "--help").stdout.split())
    assert "the same seed gives the same text (default: a new one each run)" in help_text


def test_closed_pipe_ends_quietly() -> None:
    """`edgemoe generate ... | head -n1`: the reader goes away; no traceback, the shell's SIGPIPE status."""
    cmd = [sys.executable, "-m", "edgemoe", "generate", "ROMEO.", "--max-tokens", "500", "--ignore-eos"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=300) == 141
    err = proc.stderr.read().decode()
    assert "Traceback" not in err and "Exception ignored" not in err and "error" not in err, err


@pytest.mark.parametrize("how", ["stdin", "argument"])
def test_prompt_not_utf8(how) -> None:
    if how == "stdin":
        assert_user_error(edgemoe("generate", stdin=b"caf\xe9"), "standard input is not valid UTF-8 (byte 0xe9")
    else:
        assert_user_error(edgemoe("generate", b"caf\xe9"), "PROMPT is not valid UTF-8 (byte 0xe9 at offset 3)")


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("broken")
    demo = demo_model_path()
    out = {}
    names = ("malformed", "unsupported", "missing-tensor", "no-weights", "truncated", "bad-tokenizer-config", "top-k")
    for name in names:
        shutil.copytree(demo, root / name)
        out[name] = root / name
    (out["malformed"] / "config.json").write_text("{not json")
    with open(out["truncated"] / "model.safetensors", "r+b") as f:  # what an interrupted download leaves
        f.truncate(1_000_000)
    (out["bad-tokenizer-config"] / "tokenizer_config.json").write_text("{not json")
    cfg = json.loads((demo / "config.json").read_text())
    (out["unsupported"] / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    (out["top-k"] / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 99}))
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
        ("unsupported", "supported: gemma4, gemma4_text, glm4_moe, gpt_oss, mixtral, olmoe"),
        ("missing-tensor", "lacks 1 tensors, e.g. model.layers.3.mlp.experts.gate_up_proj"),
        ("no-weights", "no *.safetensors"),
        ("truncated", "model.safetensors: Error while deserializing header"),
        ("bad-tokenizer-config", "malformed"),
        ("top-k", "top_k 99 is more than num_experts 32"),
    ],
)
def test_bad_models(broken_models, tmp_path, case, fragment) -> None:
    path = broken_models.get(case, tmp_path / "nope")
    assert_user_error(
        edgemoe("generate", "hi", "--model", str(path)),
        fragment,
        loading=case in ("missing-tensor", "no-weights", "truncated"),  # the weights, read after the config
    )


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
        (["--graph-upload", "auto"], "unrecognized arguments: --graph-upload auto"),  # settled (#45): no flag
        (["--speculative", "mtp"], "qwen2_moe checkpoints carry no multi-token-prediction head that edgemoe reads"),
        (["--speculative", "eagle"], "unknown speculative 'eagle': use off or ngram or mtp"),
        (["--speculative", "ngram", "--speculative-tokens", "0"], "speculative_tokens must be an integer >= 1"),
        (["--ple-backend", "disk"], "ple_backend disk: qwen2_moe models have no per-layer embeddings"),
        (["--ple-sync", "wait"], "ple_sync wait waits for rows read from disk"),
        (["--max-tokens", "abc"], "argument --max-tokens: invalid int value: 'abc' (see edgemoe generate --help)"),
        (["--max-model-len", "0"], "max_model_len must be an integer >= 1, got 0"),
        (["--max-model-len", "-5"], "max_model_len must be an integer >= 1, got -5"),
        (["--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1"),
        (["--kv-cache-tokens", "0"], "kv_cache_tokens must be an integer >= 1"),
        (["--kv-cache-memory", "1MiB", "--kv-cache-tokens", "64"], "give one of kv_cache_memory and kv_cache_tokens"),
        (["--kv-cache-memory", "10TB"], "cannot allocate a KV cache"),
        (["--seed", str(2**64)], "seed must be an integer"),
        (["--bogus"], "unrecognized arguments: --bogus (see edgemoe generate --help)"),
    ],
)
def test_bad_flags(args, fragment) -> None:
    built = ("per-layer embeddings", "cannot allocate a KV cache")  # found once the model is being built: after loading
    assert_user_error(edgemoe("generate", "hi", *args), fragment, loading=any(b in fragment for b in built))


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["nope"], "invalid choice: 'nope'"),
        (["serve", "--port", "x"], "argument --port: invalid int value: 'x' (see edgemoe serve --help)"),
        (["serve", "--default-max-tokens", "0"], "--default-max-tokens must be >= 1, got 0"),
        (["make-model", "/tmp/x", "--layers", "x"], "invalid int value: 'x' (see edgemoe make-model --help)"),
        (["make-model", "/tmp/x", "--layers", "-1"], "--layers must be >= 1"),
        (["cache-sim", "t.npy"], "the following arguments are required: --slots (see edgemoe cache-sim --help)"),
        (["cache-sim", __file__, "--slots", "4"], "is not a routing trace: not a .npy array"),
        (["bench", "--steps", "x"], "(see edgemoe bench --help)"),
    ],
)
def test_every_command_errs_in_one_line(args, fragment) -> None:
    assert_user_error(edgemoe(*args), fragment)


@pytest.mark.parametrize(
    "template, fragment",
    [
        ("{{ 1/0 }}", "the chat template failed: ZeroDivisionError: division by zero"),
        ("{{ messages | no_such_filter }}", "the chat template does not compile: No filter named 'no_such_filter'"),
        ("{{ raise_exception('only one user turn') }}", "chat template: only one user turn"),
    ],
)
def test_chat_template_failures(tmp_path, template, fragment) -> None:
    shutil.copytree(demo_model_path(), tmp_path / "m")
    cfg_path = tmp_path / "m" / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "chat_template": template}))
    assert_user_error(edgemoe("generate", "--chat", "hi", "--model", str(tmp_path / "m")), fragment)


def test_empty_prompt() -> None:
    assert_user_error(edgemoe("generate", stdin=""), "no prompt")


def test_make_model_round_trip(tmp_path) -> None:
    """What make-model wrote is what it was asked for (a fused qwen3_moe checkpoint of the tiny geometry: its
    config, every tensor the model needs in transformers' fused layout, a tokenizer), and generate runs it."""
    import json

    from safetensors import safe_open

    from edgemoe.tools.presets import PRESETS

    out = tmp_path / "m"
    proc = edgemoe("make-model", str(out), "--family", "qwen3_moe", "--size", "tiny", "--layout", "fused")
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    tiny = PRESETS["tiny"]
    assert config["model_type"] == "qwen3_moe" and config["num_hidden_layers"] == tiny["num_hidden_layers"]
    assert config["hidden_size"] == tiny["hidden_size"] and config["num_experts"] == tiny["num_experts"]
    names = set()
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            names |= set(h.keys())
    experts = [n for n in names if ".experts." in n]
    assert experts and all(n.endswith((".experts.gate_up_proj", ".experts.down_proj")) for n in experts)
    assert len(experts) == 2 * tiny["num_hidden_layers"] and "model.embed_tokens.weight" in names
    assert (out / "tokenizer.json").is_file()
    gen = edgemoe("generate", "hi", "--model", str(out), "--max-tokens", "4")
    assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr
    assert_user_error(edgemoe("make-model", str(tmp_path / "x"), "--family", "gpt2"), "unknown family")
    assert_user_error(edgemoe("make-model", str(tmp_path / "x"), "--size", "huge"), "unknown size")
