"""Recorded coding-agent sessions (`benchmarks/sessions/*.json`) replayed against a running `edgemoe serve`, through
the client SDKs, as the agent would send them: the share of each prompt the prefix cache served, turn by turn.

A session file holds its API (`anthropic`: the Messages API as Claude Code speaks it; `responses`: the Responses API
as Codex does, stateless), the fixed parts of every request (system prompt or instructions, tools, sampling
fields), and a script of turns: what the client appends before the turn's request (`send`: content blocks of the
user message, or input items; the tool results of the previous answer go first) and what the model answered
(`model`: its reasoning, its text, its calls, each with the result the tool gave). The history is built from what the
server actually returned, as an agent builds it: returned blocks or output items go back as they came, and the
script's tool results answer the calls the model made (paired in order; the script's `nudge` follows an answer
without calls where the script had some). On the scripted in-process server (`benchmarks/scripted_server.py`) the
model answers exactly what the script says, in the Qwen3-style template's format (`scripted_output`).

`benchmarks/agent_loop.py --session FILE` runs it and prints the table.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import anthropic
import openai

SESSIONS = Path(__file__).parent / "sessions"
NO_RESULT = "error: this call is not in the recorded session; no result"


class Clock(Protocol):
    def read(self) -> dict[str, float]: ...  # the server's /metrics sums (agent_loop.ServerClock)


class Script(Protocol):
    def push(self, *texts: str) -> None: ...  # scripted_server.ScriptedOutput


@dataclass
class SessionTurn:
    session: str
    turn: int
    prompt_tokens: int
    cached_tokens: int  # Anthropic's cache_read_input_tokens, Responses' input_tokens_details.cached_tokens
    output_tokens: int
    ttft_ms: float  # the server's (/metrics)
    calls: list[str] = field(default_factory=list)  # the tools the model called
    scripted: list[str] = field(default_factory=list)  # the tools the session's model called

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def load(path: str | Path, shorten: int | None = None) -> dict:
    """A session file. `shorten`, for a quick run with the same turns and calls: cut every string of it to that many
    characters (system texts, tool descriptions, messages, tool results, the model's reasoning, text and call
    arguments) and offer only the tools the session calls."""
    session = json.loads(Path(path).read_text())
    session.setdefault("name", Path(path).stem)
    if shorten is not None:
        called = {c["name"] for turn in session["turns"] for c in turn["model"].get("calls", [])}
        request = session["request"]
        request["tools"] = [t for t in request.get("tools", []) if t.get("name") in called]
        session["request"], session["turns"] = _cut(request, shorten), _cut(session["turns"], shorten)
    return session


def _cut(value: object, n: int) -> object:
    if isinstance(value, str):
        return value[:n]
    if isinstance(value, list):
        return [_cut(v, n) for v in value]
    return {k: _cut(v, n) for k, v in value.items()} if isinstance(value, dict) else value


def scripted_output(model: dict) -> str:
    """The session's answer as a Qwen3-style model writes it (`scripted_server.QWEN3_TEMPLATE`): reasoning in a think
    block, then the text, then each call as `<tool_call>` JSON (non-ASCII as is; a custom tool's input as the one
    argument `input`, which is how the server offers custom tools)."""
    head = f"<think>\n{model['reasoning']}\n</think>\n\n" if model.get("reasoning") else ""
    calls = [{"name": c["name"], "arguments": c["arguments"] if "arguments" in c else {"input": c["input"]}}
             for c in model.get("calls", [])]  # fmt: skip
    parts = ([model["text"]] if model.get("text") else []) + [
        f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls
    ]
    return head + "\n".join(parts)


def _results(scripted: list[dict], made: int) -> list[str | list]:
    """The results of the `made` calls the model made: the session's, in order (a call it did not record: none)."""
    return [scripted[i]["result"] if i < len(scripted) else NO_RESULT for i in range(made)]


def _read(clock: Clock | None) -> dict[str, float]:
    return clock.read() if clock is not None else {}


def _ttft_ms(before: dict[str, float], after: dict[str, float]) -> float:
    """The server's time to first token between two readings of its /metrics; NaN without a clock."""
    key = "time_to_first_token_seconds_sum"
    return 1000 * (after[key] - before[key]) if key in before else float("nan")


def anthropic_session(
    session: dict, url: str, key: str, model: str, clock: Clock | None = None, script: Script | None = None
) -> list[SessionTurn]:
    """Claude Code's way: the assistant's content blocks go back as returned (thinking with its signature, text,
    tool_use with its id); the next user message holds a tool_result per tool_use, then the turn's new blocks; the
    cache breakpoint moves to the last block of the conversation."""
    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=600)
    fixed = {k: v for k, v in session["request"].items() if k not in ("model", "stream")}
    extra = {k: fixed.pop(k) for k in ("temperature", "top_p", "top_k") if k in fixed}  # (not stream()'s parameters)
    messages: list[dict] = []
    results: list[dict] = []  # the tool_result blocks of the last answer's calls
    out = []
    for t, turn in enumerate(session["turns"]):
        content = results + copy.deepcopy(turn["send"])
        if t and not results and session["turns"][t - 1]["model"].get("calls"):
            content.append({"type": "text", "text": session["nudge"]})  # the model answered where it should call
        messages.append({"role": "user", "content": content})
        if script is not None:
            script.push(scripted_output(turn["model"]))
        before = _read(clock)
        with client.messages.stream(model=model, messages=_breakpoint(messages), extra_body=extra, **fixed) as stream:
            final = stream.get_final_message()
        usage = final.usage
        cached = usage.cache_read_input_tokens or 0
        uses = [b for b in final.content if b.type == "tool_use"]
        scripted = turn["model"].get("calls", [])
        out.append(SessionTurn(session["name"], t + 1, usage.input_tokens + cached, cached, usage.output_tokens,
                               _ttft_ms(before, _read(clock)), [b.name for b in uses],
                               [c["name"] for c in scripted]))  # fmt: skip
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]})
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": r}
                   for b, r in zip(uses, _results(scripted, len(uses)))]  # fmt: skip
    return out


def _breakpoint(messages: list[dict]) -> list[dict]:
    """The messages with one cache_control, on the last block (Claude Code moves its breakpoint each turn)."""
    out = copy.deepcopy(messages)
    for m in out:
        for block in m["content"] if isinstance(m["content"], list) else []:
            block.pop("cache_control", None)
    out[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return out


_CODEX_KEYS = {  # the fields of each output item that Codex sends back (no ids: store is false)
    "reasoning": ("type", "summary", "content", "encrypted_content"),
    "message": ("type", "role", "content"),
    "function_call": ("type", "name", "arguments", "call_id"),
    "custom_tool_call": ("type", "status", "call_id", "name", "input"),
}


def _codex_item(item: dict) -> dict:
    kept = {k: item.get(k) for k in _CODEX_KEYS[item["type"]]}
    if item["type"] == "message":
        kept["content"] = [{"type": p["type"], "text": p["text"]} for p in item["content"]]
    return kept


def responses_session(
    session: dict, url: str, key: str, model: str, clock: Clock | None = None, script: Script | None = None
) -> list[SessionTurn]:
    """Codex's way (store false): the whole conversation each turn; the output items go back as returned (reasoning
    with its text, messages, function and custom tool calls), then a function_call_output or custom_tool_call_output
    per call, then the turn's new items."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
    fixed = {k: v for k, v in session["request"].items() if k not in ("model", "stream")}
    items: list[dict] = []
    results: list[dict] = []
    out = []
    for t, turn in enumerate(session["turns"]):
        items += results + copy.deepcopy(turn["send"])
        if t and not results and session["turns"][t - 1]["model"].get("calls"):
            items.append({"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                          "text": session["nudge"]}]})  # fmt: skip
        if script is not None:
            script.push(scripted_output(turn["model"]))
        before, final = _read(clock), None
        for event in client.responses.create(model=model, input=items, stream=True, **fixed):
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        calls = [i for i in final.output if i.type in ("function_call", "custom_tool_call")]
        scripted = turn["model"].get("calls", [])
        usage = final.usage
        out.append(SessionTurn(session["name"], t + 1, usage.input_tokens, usage.input_tokens_details.cached_tokens,
                               usage.output_tokens, _ttft_ms(before, _read(clock)), [c.name for c in calls],
                               [c["name"] for c in scripted]))  # fmt: skip
        items += [_codex_item(i.model_dump()) for i in final.output]
        results = [{"type": f"{c.type}_output", "call_id": c.call_id, "output": r}
                   for c, r in zip(calls, _results(scripted, len(calls)))]  # fmt: skip
    return out


REPLAYS = {"anthropic": anthropic_session, "responses": responses_session}


def replay(
    session: dict, url: str, key: str, model: str, clock: Clock | None = None, script: Script | None = None
) -> list[SessionTurn]:
    """Replay `session` (`load`) against the server at `url`; `script`: the scripted server's, to force its answers."""
    return REPLAYS[session["api"]](session, url, key, model, clock, script)
