"""`edgemoe serve --speculative ngram`: the flag reaches the engine, a greedy completion's text is the one the
server without speculation gives, and /metrics reports the drafts and how many were accepted."""

from __future__ import annotations

import re

import httpx
import pytest

from .conftest import ServerProcess

PROMPT = "ROMEO: But soft, what light through yonder window breaks? " * 4 + "ROMEO: But soft,"


@pytest.fixture(scope="module")
def speculative(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("speculative"), "--speculative", "ngram", "--speculative-tokens", "5")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_same_text_and_drafts_in_metrics(speculative, http) -> None:
    body = {"model": "edgemoe-demo", "prompt": PROMPT, "max_tokens": 48, "temperature": 0}
    with httpx.Client(base_url=speculative.url, timeout=60) as spec:
        got = spec.post("/v1/completions", json=body).json()["choices"][0]["text"]
        metrics = spec.get("/metrics").text
    assert got == http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    values = {m[1]: float(m[2]) for m in re.finditer(r"^(edgemoe_spec_decode_\w+) (\S+)$", metrics, re.M)}
    assert values["edgemoe_spec_decode_draft_tokens"] > 0 and values["edgemoe_spec_decode_verify_steps"] > 0
    assert 0 <= values["edgemoe_spec_decode_accepted_tokens"] <= values["edgemoe_spec_decode_draft_tokens"]
