"""What an agent relies on without asking: an answer runs to the end of the context when no limit is given
(`--default-max-tokens` caps it), the tokenizing routes refuse a huge body as the generation routes do without
stalling the server, and a stream's first bytes go out at once, before the prefill ends."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import openai
import pytest
import torch

from edgemoe.engine.sequence import Sequence
from edgemoe.server import answer
from edgemoe.server.app import _sampling_params
from edgemoe.server.protocol import ChatCompletionRequest

MODEL = "qwen-tools"
LONG = " ".join(f"verse{i}" for i in range(120))  # more tokens than the old default of 256


def test_no_limit_runs_to_the_end_of_the_context(tool_server):
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=tool_server.api_key, max_retries=0, timeout=120)
    assert len(tool_server.script.tokenizer.encode(LONG, add_special_tokens=False)) > 256
    tool_server.script.push(LONG, LONG)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Recite."}])
    assert chat.choices[0].message.content == LONG and chat.choices[0].finish_reason == "stop"
    response = client.responses.create(model=MODEL, input="Recite.")
    assert response.status == "completed" and response.output_text == LONG


def test_default_max_tokens_caps_it():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    limit = (100, "the context limit")
    assert [_sampling_params(req, 10, limit, cap)[0].max_tokens for cap in (None, 20, 500)] == [90, 20, 90]
    req.max_tokens = 5
    assert _sampling_params(req, 10, limit, 20)[0].max_tokens == 5


def test_huge_bodies_are_refused_without_stalling_health(tool_server):
    """Three bodies of 3.9 MB at once (each under the 4 MiB body limit), to /v1/tokenize (a text, a conversation)
    and /v1/messages/count_tokens: refused by the size check, while /health keeps answering."""
    text = "To be, or not to be, that is the question: " * 90_000
    headers = {"Authorization": f"Bearer {tool_server.api_key}"}
    messages = [{"role": "user", "content": text}]
    bodies = [("/v1/tokenize", {"prompt": text}), ("/v1/tokenize", {"messages": messages}),
              ("/v1/messages/count_tokens", {"model": MODEL, "messages": messages})]  # fmt: skip

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(tool_server.url + path, json=body, headers=headers, timeout=120)

    latencies = []
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post, path, body) for path, body in bodies]
        while not all(f.done() for f in futures):
            start = time.perf_counter()
            assert httpx.get(f"{tool_server.url}/health", timeout=60).status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.01)
    prompt, conversation, count = (f.result() for f in futures)
    assert prompt.status_code == conversation.status_code == count.status_code == 400
    assert prompt.json()["error"]["code"] == conversation.json()["error"]["code"] == "context_length_exceeded"
    assert (prompt.json()["error"]["param"], conversation.json()["error"]["param"]) == ("prompt", "messages")
    assert count.json()["type"] == "error" and "context limit is 2048" in count.json()["error"]["message"]
    assert max(latencies) < 2.0, latencies  # tokenizing all three on the event loop's GIL took ~11 s


class Gate:
    """A logits processor that holds the engine thread at the first token of the next sequence (as a long prefill
    would) until `opened` is set."""

    def __init__(self) -> None:
        self.armed, self.opened = False, threading.Event()

    def arm(self) -> None:
        self.opened.clear()
        self.armed = True

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        if self.armed and any(not seq.output_ids for seq in seqs):
            self.armed = False
            self.opened.wait(60)
        return logits


@pytest.fixture(scope="module")
def gate(tool_server):
    gate = Gate()
    tool_server.engine_loop.engine.logits_processors.insert(0, gate)
    yield gate
    tool_server.engine_loop.engine.logits_processors.remove(gate)


STREAMS = [  # (path, body, the stream's first bytes, its last event)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, b'data: {"id":"chatcmpl', b"[DONE]"),
    ("/v1/completions", {"prompt": "hi"}, answer.KEEPALIVE.encode(), b"[DONE]"),
    ("/v1/responses", {"input": "hi"}, b"event: response.created", b"response.completed"),
    ("/v1/messages", {"max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}, answer.KEEPALIVE.encode(),
     b"message_stop"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,first,last", STREAMS, ids=[s[0].rsplit("/", 1)[1] for s in STREAMS])
def test_first_bytes_before_the_prefill_ends(tool_server, gate, monkeypatch, path, body, first, last):
    """The engine is held before the first token; the stream's first bytes (its opening event, or a comment where
    the API's first event must wait for the prefill) arrive meanwhile, then a comment every KEEPALIVE_S."""
    monkeypatch.setattr(answer, "KEEPALIVE_S", 0.05)
    tool_server.script.push("Hail.")
    gate.arm()
    headers = {"Authorization": f"Bearer {tool_server.api_key}"}
    body = {**body, "model": MODEL, "stream": True}
    with httpx.stream("POST", tool_server.url + path, json=body, headers=headers, timeout=20) as r:
        chunks = r.iter_raw()
        head = next(chunks)
        assert r.status_code == 200 and head.startswith(first) and not gate.opened.is_set()
        while (head := head + next(chunks)).count(answer.KEEPALIVE.encode()) < 2:
            pass  # comments keep coming while the engine is held
        gate.opened.set()
        rest = b"".join(chunks)
    assert last in rest  # and the stream ends as its API ends one
