"""The prefix cache through the real HTTP path: a request that repeats an earlier prompt's prefix reports the reused
tokens in `usage.prompt_tokens_details.cached_tokens` (as OpenAI's API does), gets the same greedy text, and
/metrics counts the looked-up and found tokens."""

from __future__ import annotations

import re

PROMPT = "ROMEO.\nWhat news from the court, my lord? Speak, and tell me all that passed between the houses today."


def counters(http) -> dict[str, float]:
    text = http.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(edgemoe_prefix_cache_\w+) (\S+)$", text, re.M)}


def test_cached_tokens_in_usage_and_metrics(http, client) -> None:
    before = counters(http)
    first = client.completions.create(model="edgemoe-demo", prompt=PROMPT, max_tokens=8, temperature=0)
    again = client.completions.create(model="edgemoe-demo", prompt=PROMPT, max_tokens=8, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    prompt_tokens = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16 > 0
    after = counters(http)
    assert after["edgemoe_prefix_cache_queried_tokens_total"] - before["edgemoe_prefix_cache_queried_tokens_total"] >= (
        2 * prompt_tokens
    )
    assert after["edgemoe_prefix_cache_hit_tokens_total"] - before["edgemoe_prefix_cache_hit_tokens_total"] >= 16
    assert 0 < after["edgemoe_prefix_cache_hit_rate"] <= 1
    chats = [
        client.chat.completions.create(
            model="edgemoe-demo", messages=[{"role": "user", "content": PROMPT}], max_tokens=4, temperature=0
        )
        for _ in range(2)
    ]
    assert chats[1].choices[0].message.content == chats[0].choices[0].message.content
    assert chats[1].usage.prompt_tokens_details.cached_tokens == (chats[1].usage.prompt_tokens - 1) // 16 * 16 > 0


def test_a_prompt_whose_length_proves_it_too_long_is_refused_untokenized(http) -> None:
    """90,000 characters hold at least 90,000 / (the longest vocabulary entry, 29) tokens: more than the demo model's
    2,048, so refused at once, before tokenizing: the message counts characters, which only the check before the
    tokenizer does (a tokenized prompt's counts tokens). No clock: a busy machine makes any bound on time flaky."""
    r = http.post("/v1/completions", json={"prompt": "a" * 90_000, "max_tokens": 1})  # the body limit: 100 kB
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"].startswith("the prompt has 90000 characters, at least 3103 tokens; the context")


def test_a_conversation_whose_length_proves_it_too_long_is_refused_untokenized(http) -> None:
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 90_000}]})
    assert r.status_code == 400 and "characters, at least" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"
