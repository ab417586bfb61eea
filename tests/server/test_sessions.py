"""The recorded agent sessions (`benchmarks/sessions/`: a Claude-Code-shaped one through the anthropic SDK, a
Codex-shaped one through the openai SDK's Responses) replayed on the scripted server, as `benchmarks/agent_loop.py
--session --scripted` does: every request is accepted, the usage adds up to the prompt the engine ran, and from the
second turn on each prompt starts with the previous prompt and the answer's tokens as generated (exact replay), all
of which the prefix cache serves but for the last partial block.

For speed (decode on the CPU slows with the context, and the answers are forced, ~3,400 tokens a session): every
string of the sessions is cut to SHORTEN characters and only the tools they call are offered (the same turns and
calls, `agent_sessions.load`), on the demo model's first layer (what a model would say does not matter here). The
full sessions on the whole model: benchmarks/RESULTS.md."""

from __future__ import annotations

import pytest
import torch

from benchmarks.agent_sessions import SESSIONS, load, replay, scripted_output
from benchmarks.scripted_server import QWEN3_TEMPLATE, QWEN_TOKENS, InProcessServer, PromptLog, make_model

CONTEXT = 16384
SHORTEN = 200  # characters of each string of the session (agent_sessions.load)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """The scripted server, and the log of the prompts its engine ran."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as conftest's tool_server: 2 CI cores)
    folder = tmp_path_factory.mktemp("sessions") / "qwen-tools"
    model = make_model(folder, QWEN3_TEMPLATE, QWEN_TOKENS, context=CONTEXT, layers=1)  # (answers are scripted)
    server = InProcessServer(model, kv_cache_tokens=2 * CONTEXT)
    log = PromptLog()
    server.engine_loop.engine.logits_processors.append(log)
    try:
        yield server, log
    finally:
        server.stop()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["claude_code", "codex"])
def test_session(scripted, name):
    server, log = scripted
    session = load(SESSIONS / f"{name}.json", shorten=SHORTEN)
    turns = replay(session, server.url, server.api_key, server.model_id, script=server.script)
    assert server.script.pending() == 0
    assert [t.calls for t in turns] == [t.scripted for t in turns]  # the answers were the recorded ones
    tok, end = server.script.tokenizer, server.script.end
    block = server.engine_loop.engine.kv.block_size
    prompts = log.last(len(turns))
    answers = [tok.encode(scripted_output(turn["model"]), add_special_tokens=False) + [end]
               for turn in session["turns"]]  # fmt: skip
    for k, (t, prompt, answer) in enumerate(zip(turns, prompts, answers)):
        # the API's count is the engine's: Anthropic's uncached input_tokens + cache_read_input_tokens, Responses'
        # input_tokens with cached_tokens among them
        assert (t.prompt_tokens, t.output_tokens) == (len(prompt), len(answer)) and 0 <= t.cached_tokens <= len(prompt)
        if k == 0:
            continue
        before = prompts[k - 1] + answers[k - 1]
        assert prompt[: len(before)] == before, f"turn {k + 1}: the history was re-rendered, not replayed"
        # What the prefix cache can hold of `before`: not its last token, the end of the turn the model sampled,
        # whose K/V no step computed; and whole blocks only. So the slack below the previous prompt + output is
        # ((P + O - 1) mod block) + 1 tokens, 1 to 16; nothing else (the template adds nothing in between).
        held = (len(before) - 1) // block * block
        assert t.cached_tokens >= held, f"turn {k + 1}: {t.cached_tokens} cached of the {len(before)} replayed"
