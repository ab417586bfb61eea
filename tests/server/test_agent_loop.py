"""benchmarks/agent_loop.py runs its loop through all three SDKs: scripted tool calls are executed and answered,
every turn's prompt extends the previous one, and the figures come out per turn."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path


def load_benchmark():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "agent_loop.py"
    spec = importlib.util.spec_from_file_location("agent_loop", path)
    module = sys.modules["agent_loop"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_agent_loop(tool_server, tmp_path):
    bench = load_benchmark()

    def call(name: str, args: dict) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"

    script = [call("list_files", {}), f"Reading.\n{call('read_file', {'path': 'calc.py'})}", "The divisor is wrong."]
    for _ in range(3):
        tool_server.script.push(*script)
    out = tmp_path / "turns.json"
    turns = bench.main(["--url", tool_server.url, "--api-key", tool_server.api_key, "--turns", "3",
                        "--max-tokens", "64", "--json", str(out)])  # fmt: skip
    assert tool_server.script.pending() == 0
    assert [(t.api, t.tool_calls) for t in turns] == [
        (api, calls) for api in ("openai", "anthropic", "responses") for calls in (["list_files"], ["read_file"], [])
    ]
    for api in ("openai", "anthropic", "responses"):
        prompts = [t.prompt_tokens for t in turns if t.api == api]
        assert prompts == sorted(set(prompts))  # each turn's prompt extends the last
        cached = [t.cached_tokens for t in turns if t.api == api]
        assert all(c > 0 for c in cached[1:]), cached  # and reuses the last turn's KV (the prefix cache)
    assert all(t.ttft_ms > 0 and t.output_tokens > 1 and t.decode_tok_s > 0 for t in turns)
    assert len(json.loads(out.read_text())["turns"]) == 9
