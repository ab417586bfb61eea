"""A coding agent's loop against a running `edgemoe serve`, through each client SDK: per turn, the prompt tokens, the
time to first token and the decode speed.

The conversation is scripted but real: the agent has three tools over a small fake repository (list_files,
read_file, run_tests) and a task; every turn sends the whole conversation so far, streamed. When the model calls
tools, their (deterministic) results are appended; when it answers in text, the script's next user message is.
Each prompt therefore extends the previous prompt and answer, as an agent's do: the workload a prefix cache is for.

    python benchmarks/agent_loop.py --url http://127.0.0.1:8000 [--apis openai,anthropic,responses] [--turns 6]
                                    [--max-tokens 128] [--api-key KEY] [--model NAME] [--json OUT]

Recorded sessions instead (`benchmarks/agent_sessions.py`, files in `benchmarks/sessions/`): a Claude-Code-shaped
one (Anthropic Messages) and a Codex-shaped one (Responses), replayed turn by turn; per turn the prompt tokens, the
share of them the prefix cache served (the API's own count) and the server's TTFT. `--scripted` runs them on an
in-process server instead (the demo model dressed as a Qwen3-style tool-calling model, its answers forced to the
recorded ones; no --url):

    python benchmarks/agent_loop.py --session benchmarks/sessions/claude_code.json [--session ...] [--scripted]
                                    [--shorten CHARS] [--json OUT]

TTFT and decode tok/s are the server's own (from /metrics, read around each turn: requests run one at a time):
arrival to first generated token, and (output tokens - 1) / (last token - first token). `first out ms` is what
the client saw: sending to the first streamed output (a tool call is sent once whole, so a turn that only calls
tools shows its first output late).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

SYSTEM = "You are a coding agent. Use the tools to inspect the repository, then explain and fix the bug."
TASK = "test_calc.py fails. Find out why and propose a fix."
FOLLOW_UPS = ["List the files first.", "Read calc.py.", "Run the tests.", "What exactly is wrong?",
              "Write the corrected function.", "Summarise the fix in one sentence."]  # fmt: skip
FILES = {
    "calc.py": "def mean(xs):\n    return sum(xs) / (len(xs) - 1)\n\n\ndef total(xs):\n    return sum(xs)\n",
    "test_calc.py": "from calc import mean\n\n\ndef test_mean():\n    assert mean([1, 2, 3]) == 2\n",
    "README.md": "# calc\n\nSmall statistics helpers.\n",
}
SCHEMAS = {
    "list_files": ("List the repository's files.", {}),
    "read_file": ("Read a file of the repository.", {"path": {"type": "string"}}),
    "run_tests": ("Run the test suite and return its output.", {}),
}


def run_tool(name: str, args: dict) -> str:
    if name == "list_files":
        return "\n".join(sorted(FILES))
    if name == "read_file":
        return FILES.get(str(args.get("path")), f"error: no file {args.get('path')!r}")
    if name == "run_tests":
        return "FAILED test_calc.py::test_mean - assert 3.0 == 2\n1 failed in 0.01s"
    return f"error: no tool {name!r}"


@dataclass
class Turn:
    api: str
    turn: int
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float  # the server's
    decode_tok_s: float | None  # the server's
    first_output_ms: float  # the client's
    tool_calls: list[str] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens the server's prefix cache held (its /metrics)


class ServerClock:
    """The server's time-to-first-token and end-to-end latency sums (/metrics), read before and after a turn."""

    _SUMS = re.compile(
        r"^edgemoe_(time_to_first_token_seconds_sum|e2e_request_latency_seconds_sum|prefix_cache_hit_tokens_total)"
        r" (\S+)$",
        re.M,
    )

    def __init__(self, url: str, key: str) -> None:
        self.url, self.headers = f"{url}/metrics", {"Authorization": f"Bearer {key}"}

    def read(self) -> dict[str, float]:
        text = httpx.get(self.url, headers=self.headers, timeout=30).text
        return {m[1]: float(m[2]) for m in self._SUMS.finditer(text)}

    def turn(self, api: str, turn: int, before: dict[str, float], start: float, first: float | None,
             usage: tuple[int, int], calls: list[str]) -> Turn:  # fmt: skip
        after = self.read()
        ttft = after["time_to_first_token_seconds_sum"] - before["time_to_first_token_seconds_sum"]
        e2e = after["e2e_request_latency_seconds_sum"] - before["e2e_request_latency_seconds_sum"]
        cached = int(after["prefix_cache_hit_tokens_total"] - before["prefix_cache_hit_tokens_total"])
        prompt, output = usage
        speed = (output - 1) / (e2e - ttft) if output > 1 and e2e > ttft else None
        first_ms = 1000 * ((time.perf_counter() if first is None else first) - start)
        return Turn(api, turn, prompt, output, 1000 * ttft, speed, first_ms, calls, cached)


def openai_loop(url: str, key: str, model: str, turns: int, max_tokens: int, clock: ServerClock) -> list[Turn]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
    tools = [{"type": "function", "function": {"name": n, "description": d,
              "parameters": {"type": "object", "properties": p}}} for n, (d, p) in SCHEMAS.items()]  # fmt: skip
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    out = []
    for t in range(turns):
        before, start, first, text, calls, usage = clock.read(), time.perf_counter(), None, "", {}, (0, 0)
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=tools,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage:
                usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            for choice in chunk.choices:
                d = choice.delta
                if first is None and (d.content or d.tool_calls or getattr(d, "reasoning_content", None)):
                    first = time.perf_counter()
                text += d.content or ""
                for c in d.tool_calls or []:
                    call = calls.setdefault(c.index, {"id": c.id, "name": c.function.name, "arguments": ""})
                    call["arguments"] += c.function.arguments or ""
        out.append(clock.turn("openai", t, before, start, first, usage, [c["name"] for c in calls.values()]))
        tool_calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for c in calls.values()]  # fmt: skip
        messages.append({"role": "assistant", "content": text or None, **({"tool_calls": tool_calls} if calls else {})})
        for c in calls.values():
            result = run_tool(c["name"], json.loads(c["arguments"]))
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
        if not calls:
            messages.append({"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]})
    return out


def anthropic_loop(url: str, key: str, model: str, turns: int, max_tokens: int, clock: ServerClock) -> list[Turn]:
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=600)
    tools = [{"name": n, "description": d, "input_schema": {"type": "object", "properties": p}}
             for n, (d, p) in SCHEMAS.items()]  # fmt: skip
    messages: list[dict] = [{"role": "user", "content": TASK}]
    out = []
    for t in range(turns):
        before, start, first = clock.read(), time.perf_counter(), None
        with client.messages.stream(model=model, system=SYSTEM, messages=messages, tools=tools, max_tokens=max_tokens,
                                    extra_body={"temperature": 0}) as stream:  # fmt: skip
            for event in stream:
                if first is None and event.type == "content_block_delta":
                    first = time.perf_counter()
            final = stream.get_final_message()
        uses = [b for b in final.content if b.type == "tool_use"]
        # Anthropic's input_tokens are the uncached rest of the prompt: the prefix cache's share is apart
        usage = (final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0), final.usage.output_tokens)
        out.append(clock.turn("anthropic", t, before, start, first, usage, [b.name for b in uses]))
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]})
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": run_tool(b.name, b.input)} for b in uses]
        messages.append({"role": "user", "content": results or FOLLOW_UPS[t % len(FOLLOW_UPS)]})
    return out


def responses_loop(url: str, key: str, model: str, turns: int, max_tokens: int, clock: ServerClock) -> list[Turn]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
    tools = [{"type": "function", "name": n, "description": d, "parameters": {"type": "object", "properties": p}}
             for n, (d, p) in SCHEMAS.items()]  # fmt: skip
    items: list[dict] = [{"role": "user", "content": TASK}]
    out, deltas = [], ("response.output_text.delta", "response.reasoning_text.delta", "response.output_item.added")
    for t in range(turns):
        before, start, first, final = clock.read(), time.perf_counter(), None, None
        stream = client.responses.create(model=model, instructions=SYSTEM, input=items, tools=tools,
                                         max_output_tokens=max_tokens, temperature=0, stream=True)  # fmt: skip
        for event in stream:
            if first is None and event.type in deltas:
                first = time.perf_counter()
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        calls = [i for i in final.output if i.type == "function_call"]
        usage = (final.usage.input_tokens, final.usage.output_tokens)
        out.append(clock.turn("responses", t, before, start, first, usage, [c.name for c in calls]))
        items += [i.model_dump(exclude_none=True) for i in final.output]
        items += [{"type": "function_call_output", "call_id": c.call_id,
                   "output": run_tool(c.name, json.loads(c.arguments))} for c in calls]  # fmt: skip
        if not calls:
            items.append({"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]})
    return out


LOOPS = {"openai": openai_loop, "anthropic": anthropic_loop, "responses": responses_loop}


def main(argv: list[str] | None = None) -> list[Turn]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    p.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    p.add_argument("--model", help="default: the one the server lists")
    p.add_argument("--apis", default="openai,anthropic,responses", help=f"comma-separated: {', '.join(LOOPS)}")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128, help="per turn")
    p.add_argument("--json", help="write the per-turn figures here")
    p.add_argument("--session", action="append", help="replay this recorded session instead (repeatable)")
    p.add_argument("--scripted", action="store_true", help="sessions: on an in-process scripted server (no --url)")
    p.add_argument("--shorten", type=int, help="sessions: cut system texts and tool descriptions to CHARS")
    p.add_argument("--context", type=int, default=65536, help="--scripted: the model's context in tokens")
    a = p.parse_args(argv)
    if a.session:
        return sessions(a)
    import openai

    model = a.model or openai.OpenAI(base_url=f"{a.url}/v1", api_key=a.api_key).models.list().data[0].id
    turns, clock = [], ServerClock(a.url, a.api_key)
    print(
        f"{'api':<10} {'turn':>4} {'prompt':>7} {'cached':>6} {'output':>6} {'TTFT ms':>8} {'tok/s':>7} "
        f"{'first out ms':>12}  calls"
    )
    for api in a.apis.split(","):
        for t in LOOPS[api](a.url, a.api_key, model, a.turns, a.max_tokens, clock):
            speed = "-" if t.decode_tok_s is None else f"{t.decode_tok_s:.1f}"
            print(f"{t.api:<10} {t.turn:>4} {t.prompt_tokens:>7} {t.cached_tokens:>6} {t.output_tokens:>6} "
                  f"{t.ttft_ms:>8.1f} {speed:>7} "
                  f"{t.first_output_ms:>12.1f}  {', '.join(t.tool_calls) or '-'}", flush=True)  # fmt: skip
            turns.append(t)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": model, "url": a.url, "turns": [asdict(t) for t in turns]}, f, indent=1)
    return turns


def sessions(a: argparse.Namespace) -> list:
    """Replay each recorded session against --url, or the scripted in-process server; print a row per turn."""
    from benchmarks.agent_sessions import load, replay

    tmp = tempfile.TemporaryDirectory(prefix="agent_sessions_")
    server = scripted_server(Path(tmp.name) / "qwen-tools", a.context) if a.scripted else None
    url, key = (server.url, server.api_key) if server else (a.url, a.api_key)
    try:
        import openai

        model = a.model or openai.OpenAI(base_url=f"{url}/v1", api_key=key).models.list().data[0].id
        print(
            f"{'session':<12} {'turn':>4} {'prompt':>7} {'cached':>7} {'share':>6} {'output':>6} {'TTFT ms':>8}  calls"
        )
        turns = []
        for path in a.session:
            for t in replay(load(path, a.shorten), url, key, model, ServerClock(url, key),
                            server.script if server else None):  # fmt: skip
                calls = ", ".join(t.calls) or "-"
                if t.calls != t.scripted:
                    calls += f"  (session: {', '.join(t.scripted) or '-'})"
                print(f"{t.session:<12} {t.turn:>4} {t.prompt_tokens:>7} {t.cached_tokens:>7} {t.cached_share:>6.1%} "
                      f"{t.output_tokens:>6} {t.ttft_ms:>8.1f}  {calls}", flush=True)  # fmt: skip
                turns.append(t)
    finally:
        if server:
            server.stop()
        tmp.cleanup()
    if a.json:
        with open(a.json, "w") as f:
            rows = [{**asdict(t), "cached_share": t.cached_share} for t in turns]
            json.dump({"model": model, "url": url, "scripted": a.scripted, "turns": rows}, f, indent=1)
    return turns


def scripted_server(folder: Path, context: int):
    """The in-process scripted server on the demo model (written to `folder`) with `context` tokens, and a KV cache
    for two such sequences."""
    import torch

    from benchmarks.scripted_server import QWEN3_TEMPLATE, QWEN_TOKENS, InProcessServer, make_model

    # one torch thread: the engine shares this process (and its GIL) with uvicorn and the client; an OpenMP team
    # beside them spins at its barriers (tests/server/conftest.py saw 5 ms decode steps turn into 1 s)
    torch.set_num_threads(1)
    model = make_model(folder, QWEN3_TEMPLATE, QWEN_TOKENS, context=context)
    return InProcessServer(model, kv_cache_tokens=2 * context)


if __name__ == "__main__":
    main(sys.argv[1:])
