"""Chat templates of the other tool-call families for the server tests: Qwen3.5's refusal of later system
messages, Qwen3-Coder's XML calls, Mistral's [TOOL_CALLS]. The Qwen3-style template, `make_model` and the scripted
in-process server are in `benchmarks/scripted_server.py`."""

from __future__ import annotations

from benchmarks.scripted_server import QWEN3_TEMPLATE

# Qwen3.5's refusal of a system message after the first (its templates raise; the server renders it in place)
REFUSING_TEMPLATE = QWEN3_TEMPLATE.replace(
    "{%- elif m.role in ('user', 'system') %}",
    "{%- elif m.role == 'system' %}{{- raise_exception('System message must be at the beginning.') }}\n"
    "{%- elif m.role == 'user' %}",
)
assert REFUSING_TEMPLATE != QWEN3_TEMPLATE

# Qwen3-Coder's shape: XML calls (only what detection and rendering read)
CODER_TEMPLATE = """
{%- for m in messages %}
{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}
{%- for call in m.tool_calls or [] %}
{{- '<tool_call>\\n<function=' + call.function.name + '>\\n' }}
{%- for k, v in call.function.arguments | items %}
{{- '<parameter=' + k + '>\\n' + (v | string) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if tools %}{{- '<|im_start|>system\\n' + (tools | length | string) + ' tools<|im_end|>\\n' }}{%- endif %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Mistral's shape: [AVAILABLE_TOOLS], [TOOL_CALLS] with 9-character ids, [TOOL_RESULTS]
MISTRAL_TEMPLATE = """
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}{{- '[INST]' + m.content + '[/INST]' }}
{%- elif m.role == 'assistant' and m.tool_calls %}
{{- '[TOOL_CALLS][' }}
{%- for c in m.tool_calls %}
{%- if c.id | length != 9 %}{{- raise_exception('Tool call ids must be 9 alphanumeric characters') }}{%- endif %}
{{- '{"name": "' + c.function.name + '", "arguments": ' + (c.function.arguments | tojson) + ', "id": "' + c.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif m.role == 'assistant' %}{{- m.content + eos_token }}
{%- elif m.role == 'tool' %}
{{- '[TOOL_RESULTS]{"content": ' + (m.content | tojson) + ', "call_id": "' + m.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}
"""
# GLM-4.5's markup as whole tokens (its template: `edgemoe.tools.chat_templates.GLM`)
GLM_TOKENS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<tool_call>",
              "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>", "</think>",
              "<tool_response>", "</tool_response>"]  # fmt: skip
MISTRAL_TOKENS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                  "[/TOOL_RESULTS]"]  # fmt: skip
