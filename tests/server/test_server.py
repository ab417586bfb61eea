"""`edgemoe serve` end to end: a real server process on the demo model, driven by the official `openai` client
and by raw HTTP. Every network wait is bounded in time."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from edgemoe import demo_model_path
from edgemoe.tokenizer import Tokenizer

from .conftest import MAX_BODY, MAX_QUEUE, MAX_RUNNING, MODEL, ServerProcess

CHAT = [{"role": "system", "content": "You are a player."}, {"role": "user", "content": "What news on the Rialto?"}]
PROMPTS = ["ROMEO:", "JULIET:\nO", "To be, or not", "KING HENRY:", "First Citizen:\nWe", "HAMLET:\nMy lord",
           "What light", "Now is the winter"]  # fmt: skip


def sse_events(lines) -> list[str]:
    """The data payloads of an SSE stream, in order; checks the framing on the way (comment lines, which a stream
    sends before its first output, are skipped as SSE clients skip them)."""
    events = []
    for line in lines:
        if line and not line.startswith(":"):
            assert line.startswith("data: "), line
            events.append(line[len("data: ") :])
    return events


def metrics(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def wait_idle(http: httpx.Client, timeout: float = 120) -> dict[str, float]:  # generous: a busy machine
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if m["edgemoe_num_requests_running"] == 0 and m["edgemoe_num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"gauges not back at 0: {m}"
        time.sleep(0.05)


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


# ---------------------------------------------------------------------------------------------- basics


def test_health_models(server, http, client):
    assert http.get("/health").json() == {"status": "ok"}
    assert "edgemoe_expert_cache_hit_rate" not in http.get("/metrics").text  # experts resident: nothing to count
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    # the start-up line, as `edgemoe generate` prints it: what runs where
    line = r"edgemoe: the demo model \(qwen2_moe\) on cpu, float32 \(auto: [^)]*\): 12\.6 M parameters .*, loaded in "
    assert re.search(line, server.err.read_text()), server.err.read_text()
    # while loading, /health may only have said 503 (with an error body) before it said 200
    for r in server.health_seen:
        assert r.status_code in (200, 503)
        if r.status_code == 503:
            assert_error(r, 503)


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, usage = chunks
    assert usage.choices == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: the second request reuses
    assert [getattr(usage.usage, c) for c in counts] == [getattr(full.usage, c) for c in counts]
    assert [c.choices[0].finish_reason for c in body][-1] == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in body) == full.choices[0].message.content


def test_completions_stream_equals_non_stream(client):
    ids = Tokenizer(demo_model_path()).encode("ROMEO:\nWhat")
    for prompt in ("ROMEO:\nWhat", ids, ["ROMEO:\nWhat"], [ids]):
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        assert full.object == "text_completion" and full.usage.prompt_tokens == len(ids)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                stream=True))  # fmt: skip
        assert len({c.id for c in chunks}) == 1
        assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
        assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_model_folder_and_characters_never_split(tmp_path):
    """Served from a folder: the model id is the folder's name. A random-weight model (demo tokenizer) emits
    byte-level tokens freely (the demo model never leaves ASCII): no delta ends in an incomplete byte sequence,
    and the deltas add up to the non-streamed text of the same seed. (Whole multi-byte characters held back
    until complete: tests/test_tokenizer.py, on the detokenizer the server streams from.)"""
    from edgemoe.tools.make_model import make_model

    folder = make_model(tmp_path / "rnd-tiny", "qwen2_moe", "tiny", dtype="float32")
    server = ServerProcess(tmp_path, "--model", str(folder))
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == ["rnd-tiny"]  # the folder's name
        kw = dict(model="rnd-tiny", prompt="日本語 ü ß «très»", max_tokens=64, temperature=1.0)
        multibyte = 0  # deltas holding non-ASCII text
        for seed in range(4):
            full = client.completions.create(seed=seed, **kw).choices[0].text
            deltas = [c.choices[0].text for c in client.completions.create(seed=seed, stream=True, **kw)]
            assert "".join(deltas) == full
            assert not any(d.endswith("\ufffd") for d in deltas), deltas
            multibyte += sum(not d.isascii() for d in deltas)
        assert multibyte  # the checks above met byte-level output
    finally:
        server.stop()


def test_raw_sse_framing(http):
    body = {"prompt": "ROMEO:", "max_tokens": 5, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n") and raw.count("data: [DONE]") == 1
    events = sse_events(raw.split("\n"))
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"


def test_n_seed_stop_and_max_completion_tokens(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, top_p=0.9, extra_body={"top_k": 50})
    both = client.chat.completions.create(n=2, seed=7, **kw)
    assert [c.index for c in both.choices] == [0, 1]
    alone = [client.chat.completions.create(seed=7 + i, **kw) for i in range(2)]  # choice i runs with seed + i
    assert [a.choices[0].message.content for a in alone] == [c.message.content for c in both.choices]
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens
    capped = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"
    free = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=40, temperature=0).choices[0].text
    stop = free.strip().split()[1]
    cut = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=40, temperature=0, stop=[stop, "zzz"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.index(stop)]


# ---------------------------------------------------------------------------------------------- bad input

CHAT_URL, COMP_URL = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = [  # (id, path, kwargs for httpx, status, param or "any")
    ("not-json", COMP_URL, dict(content=b"{bad", headers={"content-type": "application/json"}), 400, None),
    ("empty-body", COMP_URL, dict(content=b"", headers={"content-type": "application/json"}), 400, None),
    ("not-object", COMP_URL, dict(json=[1, 2]), 400, None),
    ("bad-utf8", COMP_URL, dict(content=b'{"prompt":"\xff"}', headers={"content-type": "application/json"}), 400,
     None),
    ("deep-json", COMP_URL, dict(content=b"[" * 40_000 + b"]" * 40_000,
                                 headers={"content-type": "application/json"}), 400, None),
    ("form-content-type", COMP_URL, dict(data={"prompt": "hi"}), 415, None),
    ("no-content-type", COMP_URL, dict(content=b'{"prompt":"hi"}'), 415, None),
    ("no-messages", CHAT_URL, dict(json={"model": MODEL}), 400, "messages"),
    ("empty-messages", CHAT_URL, dict(json={"messages": []}), 400, "messages"),
    ("messages-string", CHAT_URL, dict(json={"messages": "hi"}), 400, "messages"),
    ("no-role", CHAT_URL, dict(json={"messages": [{"content": "hi"}]}), 400, "messages.0.role"),
    ("bad-role", CHAT_URL, dict(json={"messages": [{"role": "wizard", "content": "hi"}]}), 400, "messages.0.role"),
    ("role-int", CHAT_URL, dict(json={"messages": [{"role": 1, "content": "hi"}]}), 400, "messages.0.role"),
    ("content-int", CHAT_URL, dict(json={"messages": [{"role": "user", "content": 5}]}), 400, "messages.0.content"),
    ("content-image", CHAT_URL, dict(json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
     400, "messages.0.content"),
    ("lone-surrogate", CHAT_URL, dict(content=b'{"messages":[{"role":"user","content":"a\\ud800"}]}',
                                      headers={"content-type": "application/json"}), 400, "messages"),
    ("no-prompt", COMP_URL, dict(json={"max_tokens": 3}), 400, "prompt"),
    ("max-tokens-0", COMP_URL, dict(json={"prompt": "hi", "max_tokens": 0}), 400, "max_tokens"),
    ("max-tokens-str", COMP_URL, dict(json={"prompt": "hi", "max_tokens": "5"}), 400, "max_tokens"),
    ("max-completion-tokens-0", CHAT_URL, dict(json={"messages": MSG, "max_completion_tokens": 0}), 400,
     "max_completion_tokens"),
    ("temperature-neg", COMP_URL, dict(json={"prompt": "hi", "temperature": -0.1}), 400, "temperature"),
    ("temperature-3", CHAT_URL, dict(json={"messages": MSG, "temperature": 3}), 400, "temperature"),
    ("temperature-nan", COMP_URL, dict(content=b'{"prompt":"hi","temperature":NaN}',
                                       headers={"content-type": "application/json"}), 400, "temperature"),
    ("temperature-inf", COMP_URL, dict(content=b'{"prompt":"hi","temperature":Infinity}',
                                       headers={"content-type": "application/json"}), 400, "temperature"),
    ("top-p-0", COMP_URL, dict(json={"prompt": "hi", "top_p": 0}), 400, "top_p"),
    ("top-p-1.5", COMP_URL, dict(json={"prompt": "hi", "top_p": 1.5}), 400, "top_p"),
    ("top-k--2", COMP_URL, dict(json={"prompt": "hi", "top_k": -2}), 400, "top_k"),
    ("min-p-2", COMP_URL, dict(json={"prompt": "hi", "min_p": 2}), 400, "min_p"),
    ("n-0", COMP_URL, dict(json={"prompt": "hi", "n": 0}), 400, "n"),
    ("n-over-capacity", COMP_URL, dict(json={"prompt": "hi", "n": MAX_RUNNING + MAX_QUEUE + 1}), 400, "n"),
    ("stop-empty", COMP_URL, dict(json={"prompt": "hi", "stop": ""}), 400, "stop"),
    ("stop-list-empty-string", CHAT_URL, dict(json={"messages": MSG, "stop": ["x", ""]}), 400, "stop"),
    ("stop-int", COMP_URL, dict(json={"prompt": "hi", "stop": 5}), 400, "stop"),
    ("stop-list-int", COMP_URL, dict(json={"prompt": "hi", "stop": ["a", 3]}), 400, "stop"),
    ("prompt-null", COMP_URL, dict(json={"prompt": None}), 400, "prompt"),
    ("prompt-int", COMP_URL, dict(json={"prompt": 5}), 400, "prompt"),
    ("message-string", CHAT_URL, dict(json={"messages": ["hi"]}), 400, "messages.0"),
    ("stream-options-string", CHAT_URL, dict(json={"messages": MSG, "stream": True, "stream_options": "x"}), 400,
     "stream_options"),
    ("prompt-empty", COMP_URL, dict(json={"prompt": ""}), 400, "prompt"),
    ("ids-empty", COMP_URL, dict(json={"prompt": []}), 400, "prompt"),
    ("ids-negative", COMP_URL, dict(json={"prompt": [1, -1]}), 400, "prompt"),
    ("ids-vocab", COMP_URL, dict(json={"prompt": [1, 6144]}), 400, "prompt"),
    ("ids-float", COMP_URL, dict(json={"prompt": [1, 2.5]}), 400, "prompt"),
    ("batch-prompts", COMP_URL, dict(json={"prompt": ["a", "b"]}), 400, "prompt"),
    ("context-overflow", COMP_URL, dict(json={"prompt": "hi", "max_tokens": 5000}), 400, "max_tokens"),
    ("context-overflow-stream", CHAT_URL, dict(json={"messages": MSG, "max_tokens": 5000, "stream": True}), 400,
     "max_tokens"),
    ("prompt-too-long", COMP_URL, dict(json={"prompt": list(range(1, 2100))}), 400, "prompt"),
    ("stream-options-no-stream", COMP_URL, dict(json={"prompt": "hi", "stream_options": {"include_usage": True}}),
     400, "stream_options"),
    ("tools", CHAT_URL, dict(json={"messages": MSG, "tools": [{"type": "function"}]}), 400, "tools"),
    ("unknown-model", CHAT_URL, dict(json={"messages": MSG, "model": "gpt-4"}), 404, "model"),
    ("oversized", COMP_URL, dict(json={"prompt": "a" * (MAX_BODY + 1)}), 413, None),
    ("oversized-chunked", COMP_URL, dict(content=iter([b'{"prompt":"', b"a" * MAX_BODY, b'"}']),
                                         headers={"content-type": "application/json"}), 413, None),
]  # fmt: skip


@pytest.mark.parametrize("path,kwargs,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request(http, path, kwargs, status, param):
    if isinstance(kwargs.get("json"), dict) and kwargs["json"].get("stream"):  # a 400 before any SSE byte
        with http.stream("POST", path, **kwargs) as r:
            r.read()
    else:
        r = http.post(path, **kwargs)
    assert_error(r, status, param)


def test_error_messages_name_no_internals(http):
    """What the client sent, in its own words: no pydantic union tags (`stop.str`), no class names."""
    bodies = [(COMP_URL, {"prompt": "hi", "stop": 5}), (COMP_URL, {"prompt": 5}), (CHAT_URL, {"messages": ["hi"]}),
              (CHAT_URL, {"messages": MSG, "stream_options": 1, "stream": True})]  # fmt: skip
    for path, body in bodies:
        message = assert_error(http.post(path, json=body), 400)["message"]
        for internal in (".str", "list[", "instance of", "ChatMessage", "StreamOptions", "dictionary"):
            assert internal not in message, message
    assert (
        "must be a string or a list of strings" in assert_error(http.post(COMP_URL, json=bodies[0][1]), 400)["message"]
    )


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_still_answers_after_bad_requests(http, client):
    assert http.get("/health").status_code == 200
    out = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1
    errors = metrics(http)
    assert errors.get('edgemoe_request_errors_total{status="400"}', 0) > 0
    assert not any(k.startswith("edgemoe_request_errors_total") and '"5' in k for k in errors)


# ---------------------------------------------------------------------------------------------- concurrency


def test_eight_concurrent_streams(client, server):
    greedy = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text
              for p in PROMPTS]  # fmt: skip
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                  stream=True)  # fmt: skip
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        async with aclient:
            return await asyncio.wait_for(asyncio.gather(*map(one, PROMPTS)), 60)

    assert asyncio.run(main()) == greedy


def test_disconnect_mid_stream_frees_the_sequence(http, client):
    before = metrics(http)
    body = {"prompt": "ROMEO:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=str(http.base_url), timeout=30) as own:
        with own.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert len([line for line, _ in zip(lines, range(6)) if line]) == 3
    after = wait_idle(http)
    key = 'edgemoe_sequences_finished_total{finish_reason="abort"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["edgemoe_generation_tokens_total"] - before["edgemoe_generation_tokens_total"] < 1500
    assert after["edgemoe_kv_cache_usage_ratio"] == 0
    assert client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=3, temperature=0).choices[0].text


def test_full_queue_gets_429_and_clients_leaving_free_everything(http, client):
    capacity = MAX_RUNNING + MAX_QUEUE
    body = {"messages": MSG, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=str(http.base_url), timeout=30) as own:
        streams = [own.stream("POST", CHAT_URL, json=body) for _ in range(capacity)]
        responses = [s.__enter__() for s in streams]
        # keep the line iterators: a dropped one closes its response (httpx), which the server sees as a disconnect
        lines = [r.iter_lines() for r in responses]
        try:
            for r, it in zip(responses, lines):  # the role chunk comes once the request is admitted
                assert r.status_code == 200 and next(it).startswith("data: ")
            m = metrics(http)
            assert m["edgemoe_num_requests_running"] == MAX_RUNNING
            assert m["edgemoe_num_requests_waiting"] == MAX_QUEUE
            assert m["edgemoe_kv_cache_usage_ratio"] > 0
            r = http.post(CHAT_URL, json={"messages": MSG, "max_tokens": 2})
            assert_error(r, 429)
            assert int(r.headers["retry-after"]) >= 1
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    wait_idle(http)
    assert client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3).usage.completion_tokens >= 1


def test_metric_counts_match_what_was_sent(http, client):
    before = wait_idle(http)
    a = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="HAMLET:", max_tokens=7, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    b = chunks[-1]
    c = client.completions.create(model=MODEL, prompt="KING:", max_tokens=5, n=3, seed=1,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    after = wait_idle(http)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    usages = [a.usage, b.usage, c.usage]
    assert delta("edgemoe_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("edgemoe_generation_tokens_total") == sum(u.completion_tokens for u in usages) == \
        a.usage.completion_tokens + b.usage.completion_tokens + 15  # fmt: skip
    sequences = 1 + 1 + 3
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"edgemoe_{hist}_count") == sequences
    assert delta("edgemoe_inter_token_latency_seconds_count") == sum(u.completion_tokens for u in usages) - sequences
    finished = sum(delta(f'edgemoe_sequences_finished_total{{finish_reason="{r}"}}') for r in ("stop", "length"))
    assert finished == sequences


# ---------------------------------------------------------------------------------------------- api key, shutdown


def test_api_key_kv_limit_and_graceful_shutdown(tmp_path):
    # experts offloaded with statistics on: /metrics then carries the expert-cache hit rate and the misses, copied and
    # computed on the CPU (one a layer-step), and with prompt lookup what refused drafts cost (nothing drafted here)
    flags = ("--moe-strategy", "offload", "--moe-cache-slots", "64", "--moe-collect-stats", "--moe-cpu-compute", "1",
             "--speculative", "ngram")  # fmt: skip
    server = ServerProcess(tmp_path, "--api-key", "s3cret", "--kv-cache-memory", "6MB", *flags)  # 52 KV blocks
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/health").status_code == 200
            for path in ("/v1/models", "/metrics", "/v1/nothing"):
                assert_error(http.get(path), 401)
                assert_error(http.get(path, headers={"Authorization": "Bearer wrong"}), 401)
            assert_error(http.post(COMP_URL, json={"prompt": "hi"}), 401)
            assert http.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
            errors = metrics(httpx.Client(base_url=server.url, headers={"Authorization": "Bearer s3cret"}))
            assert errors['edgemoe_request_errors_total{status="401"}'] == 3 * 2 + 1 + 1  # every 401 counted
            authed = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0, timeout=30)
            assert authed.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3).choices
            text = http.get("/metrics", headers={"Authorization": "Bearer s3cret"}).text
            hit_rate = float(re.search(r"^edgemoe_expert_cache_hit_rate (\S+)$", text, re.M)[1])
            assert 0 < hit_rate < 1
            for served in ("copy", "cpu"):
                assert float(re.search(rf'^edgemoe_expert_cache_misses{{served="{served}"}} (\S+)$', text, re.M)[1]) > 0
            assert float(re.search(r"^edgemoe_spec_decode_refused_expert_bytes (\S+)$", text, re.M)[1]) >= 0

            # fits the context (2048) but not the KV cache: refused before any SSE byte, naming max_tokens
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError, match="KV cache") as exc:
                    authed.completions.create(model=MODEL, prompt="hi", max_tokens=1000, stream=stream)
                assert exc.value.param == "max_tokens"
            with pytest.raises(openai.BadRequestError, match="KV cache") as exc:  # the prompt alone does not fit
                authed.completions.create(model=MODEL, prompt=list(range(1, 900)), max_tokens=1)
            assert exc.value.param == "prompt"

            # SIGTERM: new requests get 503, requests in flight finish; a second SIGTERM ends those left with an
            # error event; the process exits 0
            def stream(max_tokens: int):
                return authed.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})  # fmt: skip

            long, short = stream(500), stream(8)  # short: it must end within the grace even on a busy CPU
            next(long)
            first_short = next(short)
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while http.get("/health").status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            refused = http.post(COMP_URL, json={"prompt": "hi"}, headers={"Authorization": "Bearer s3cret"})
            assert_error(refused, 503)
            rest = list(short)
            assert rest[-1].choices[0].finish_reason == "length"
            assert "".join(c.choices[0].text for c in [first_short, *rest]) != ""
            assert server.proc.poll() is None  # still draining: the long stream is in flight
            server.proc.send_signal(signal.SIGTERM)
            with pytest.raises(openai.APIError, match="shutting down"):
                list(long)
        assert server.proc.wait(20) == 0
        assert f"at {server.url}/v1" in server.out.read_text()
    finally:
        server.stop(signal.SIGKILL)
        print(server.err.read_text())  # shown if the test fails


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgemoe", "serve", *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_cli_errors_are_one_line(tmp_path, server):
    truncated = tmp_path / "truncated"  # what an interrupted download leaves: fails in the engine thread
    shutil.copytree(demo_model_path(), truncated)
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(1_000_000)
    cases = [
        # every case not about the port listens on a free one: the default (8000) may be taken on a shared machine
        (("--port", "0", "--model", str(tmp_path / "missing")), "does not exist"),
        (("--port", "0", "--model", str(truncated)), "model.safetensors: Error while deserializing header"),
        (("--port", "0", "--max-model-len", "0"), "max_model_len must be an integer >= 1"),
        (("--port", "x"), "invalid int value: 'x' (see edgemoe serve --help)"),
        (("--port", "70000"), "--port"),
        (("--port", str(server.port)), "cannot listen"),  # taken by the session server
        (("--port", "0", "--dtype", "float16"), "float16"),  # fails in the engine thread, while loading
    ]
    for args, words in cases:
        r = run_cli(*args)
        assert r.returncode == 2, r
        lines = [line for line in r.stderr.splitlines() if not line.startswith("edgemoe: loading")]
        assert len(lines) == 1 and lines[0].startswith("edgemoe: error:") and words in lines[0], r.stderr


def test_chat_template_failures_are_400s(tmp_path):
    """A template that fails on the messages (`{{ 1/0 }}`) or does not compile (an unknown filter): the server
    starts, chat requests get a 400 naming `messages`, and completions, which need no template, still work."""
    cases = [("{{ 1/0 }}", "ZeroDivisionError"), ("{{ messages | no_such_filter }}", "does not compile")]
    for i, (template, words) in enumerate(cases):
        folder = tmp_path / f"m{i}"
        shutil.copytree(demo_model_path(), folder)
        cfg_path = folder / "tokenizer_config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "chat_template": template}))
        server = ServerProcess(tmp_path, "--model", str(folder))
        try:
            server.wait_ready()
            with httpx.Client(base_url=server.url, timeout=30) as http:
                for stream in (False, True):
                    body = {"messages": MSG, "max_tokens": 3, "stream": stream}
                    with http.stream("POST", CHAT_URL, json=body) as r:
                        r.read()
                    assert words in assert_error(r, 400, "messages")["message"]
                r = http.post(COMP_URL, json={"prompt": "ROMEO:", "max_tokens": 3})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
                assert metrics(http).get('edgemoe_request_errors_total{status="400"}') == 2
        finally:
            server.stop()
        assert "Traceback" not in server.err.read_text()
