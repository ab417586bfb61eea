"""Every API reports the prompt tokens the prefix cache held, as the engine counted them, on an agent's second turn
(its prompt starts with the first turn's prompt and answer), through the official SDKs, whole and streamed: OpenAI
chat in `prompt_tokens_details.cached_tokens`, Anthropic in `cache_read_input_tokens` (with `input_tokens` the
uncached rest, in message_start and in the final message), Responses in `input_tokens_details.cached_tokens`; and
/metrics counts the same tokens looked up and found."""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest
import torch

from edgemoe.engine.sequence import Sequence

MODEL = "qwen-tools"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "18 C in Paris."
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
QUESTION = "Weather in Paris?"


class EngineCounts:
    """A logits processor that changes nothing: it records each sequence's prompt length and the prompt tokens the
    engine read from the prefix cache (`Sequence.num_cached`) when its first token is due."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[int, int]] = {}  # request id -> (prompt tokens, cached tokens), in arrival order

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        for seq in seqs:
            self.seen.setdefault(seq.request_id, (seq.num_prompt_tokens, seq.num_cached))
        return logits

    def last(self) -> tuple[int, int]:
        return list(self.seen.values())[-1]


@pytest.fixture(scope="module")
def counts(tool_server):
    engine = tool_server.engine_loop.engine
    counts = EngineCounts()
    engine.logits_processors.append(counts)
    yield counts
    engine.logits_processors.remove(counts)


def system(api: str, stream: bool) -> str:
    """A system prompt no other test sends: the first turn finds nothing cached, whatever ran before."""
    return f"Test {api}, {'streamed' if stream else 'whole'}: be brief."


def prefix_counters(tool_server) -> tuple[float, float]:
    """/metrics' prompt tokens looked up in the prefix cache and found there, so far."""
    text = httpx.get(f"{tool_server.url}/metrics", headers={"Authorization": f"Bearer {tool_server.api_key}"}).text
    found = dict(re.findall(r"^edgemoe_prefix_cache_(\w+)_tokens_total (\S+)$", text, re.M))
    return float(found["queried"]), float(found["hit"])


@pytest.fixture
def metrics(tool_server):
    """Checks, after the test's two turns, that /metrics counted their prompts and cached tokens as usage did."""
    before = prefix_counters(tool_server)
    turns: list[tuple[int, int]] = []
    yield turns
    queried, hit = (after - was for after, was in zip(prefix_counters(tool_server), before))
    assert (queried, hit) == (sum(p for p, _ in turns), sum(c for _, c in turns)) and hit > 0


def check_turns(
    tool_server, counts: EngineCounts, first: tuple[int, int], second: tuple[int, int], metrics: list | None = None
) -> int:
    """`first`, `second`: each turn's (prompt tokens, cached tokens) as the API reported them. The engine's own
    count must match; the first turn found nothing, the second at least the first's prompt (in whole KV blocks).
    `metrics`: where the `metrics` fixture takes the turns to compare with /metrics."""
    assert tool_server.script.pending() == 0
    if metrics is not None:
        metrics += [first, second]
    block = tool_server.engine_loop.engine.kv.block_size
    engine_first, engine_second = list(counts.seen.values())[-2:]
    assert first == engine_first and first[1] == 0
    assert second == engine_second and second[1] >= first[0] // block * block > 0
    return second[1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_chat(tool_server, counts, metrics, stream):
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=tool_server.api_key, max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    messages = [{"role": "system", "content": system("chat", stream)}, {"role": "user", "content": QUESTION}]
    tool_server.script.push(CALL, ANSWER)
    one = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    call = one.choices[0].message
    messages += [call.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "18 C"}]  # fmt: skip
    if stream:
        with client.chat.completions.stream(model=MODEL, messages=messages, tools=tools,
                                            stream_options={"include_usage": True}) as s:  # fmt: skip
            two = s.get_final_completion()
    else:
        two = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    assert two.choices[0].message.content == ANSWER
    turns = [(r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens) for r in (one, two)]
    check_turns(tool_server, counts, *turns, metrics)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic(tool_server, counts, metrics, stream):
    client = anthropic.Anthropic(base_url=tool_server.url, api_key=tool_server.api_key, max_retries=0, timeout=60)
    kw = dict(model=MODEL, max_tokens=256, system=system("anthropic", stream),
              tools=[{"name": "get_weather", "input_schema": SCHEMA}])  # fmt: skip
    messages = [{"role": "user", "content": QUESTION}]
    tool_server.script.push(CALL, ANSWER)
    one = client.messages.create(messages=messages, **kw)
    (use,) = [b for b in one.content if b.type == "tool_use"]
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in one.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]},
    ]
    if stream:
        with client.messages.stream(messages=messages, **kw) as s:
            events = list(s)
            two = s.get_final_message()
        # message_start knows the prompt's counts and message_delta repeats them (Anthropic's are cumulative there):
        # a client may read either
        (start,) = [e.message.usage for e in events if e.type == "message_start"]
        (delta,) = [e.usage for e in events if e.type == "message_delta"]
        assert start.model_dump() == {**two.usage.model_dump(), "output_tokens": 0}
        assert delta.model_dump(exclude_none=True) == two.usage.model_dump(exclude_none=True)
    else:
        two = client.messages.create(messages=messages, **kw)
    assert two.content[0].text == ANSWER
    turns = [(m.usage.input_tokens + m.usage.cache_read_input_tokens, m.usage.cache_read_input_tokens)
             for m in (one, two)]  # fmt: skip
    cached = check_turns(tool_server, counts, *turns, metrics)
    assert two.usage.input_tokens == counts.last()[0] - cached > 0 and two.usage.cache_creation_input_tokens == 0
    count = client.messages.count_tokens(model=MODEL, system=kw["system"], tools=kw["tools"], messages=messages)
    assert count.input_tokens == counts.last()[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses(tool_server, counts, metrics, stream):
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=tool_server.api_key, max_retries=0, timeout=60)
    kw = dict(model=MODEL, instructions=system("responses", stream),
              tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA}])  # fmt: skip
    items = [{"role": "user", "content": QUESTION}]
    tool_server.script.push(CALL, ANSWER)
    one = client.responses.create(input=items, **kw)
    (call,) = [i for i in one.output if i.type == "function_call"]
    items += [call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                                                    "output": "18 C"}]  # fmt: skip
    if stream:
        with client.responses.stream(input=items, **kw) as s:
            two = s.get_final_response()
    else:
        two = client.responses.create(input=items, **kw)
    assert two.output_text == ANSWER
    turns = [(r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens) for r in (one, two)]
    check_turns(tool_server, counts, *turns, metrics)
