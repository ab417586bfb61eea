"""The README's client commands (coding agents section), run as written on the demo model: the served model's name and
the server's address put in, nothing else changed. The tools example must get a 200: the demo model's template has
a tools branch (it answers in text). And the README lists every request field the server refuses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from edgemoe.server.protocol import _UNSUPPORTED

from .conftest import MODEL

README = Path(__file__).resolve().parents[2] / "README.md"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def readme_commands() -> list[str]:
    """The `python -c "..."` client commands of the README, as Python source."""
    return re.findall(r'^python -c "(import (?:openai|anthropic);.*)"$', README.read_text(), re.M)


def test_the_readme_has_its_three_client_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 3 and sum("tools=" in c for c in commands) == 1, commands


@pytest.mark.parametrize("index", range(3))
def test_readme_client_command_runs_on_the_demo_model(server, index: int) -> None:
    code = readme_commands()[index]
    code = code.replace("http://127.0.0.1:8000", server.url).replace("model='Qwen3-30B-A3B'", f"model='{MODEL}'")
    assert server.url in code and f"model='{MODEL}'" in code
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_a_request_with_tools_gets_a_200(http) -> None:
    """curl's view of the README's tools example: the demo model answers in text, or in a call if it writes one."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [TOOL],
            "max_tokens": 16}  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] or message.get("tool_calls")


def test_the_readme_lists_the_refused_fields() -> None:
    text = " ".join(README.read_text().split())
    assert "Refused with a 400 naming the field" in text
    for name in (*_UNSUPPORTED, "previous_response_id", "conversation", "background"):
        assert f"`{name}`" in text, name
