"""The chat templates that the demo model and `edgemoe make-model` checkpoints ship: ChatML turns with a tools branch in
Qwen's format (tools listed in the system turn, calls as `<tool_call>{json}</tool_call>`, results as
`<tool_response>` in a user turn), Qwen3.5's (the same turns, calls as XML), Mistral's (`[AVAILABLE_TOOLS]`,
`[TOOL_CALLS]`, `[TOOL_RESULTS]`) for the Mixtral family, and GLM-4.5's
(`<tool_call>NAME<arg_key>..</arg_key><arg_value>..</arg_value></tool_call>`) for glm4_moe, and OpenAI's harmony
(channels, calls addressed `to=functions.NAME`) for gpt_oss. `edgemoe.server.chat_format.detect_formats` reads them as
the `qwen`, `qwen3_coder`, `mistral`, `glm` and `harmony` formats.

Without tools, the Qwen template renders exactly what the demo model was trained on, `<|im_start|>ROLE\\nTEXT<|im_end|>`
per message, with no default system turn."""

from __future__ import annotations

# Qwen2.5's tools branch, word for word where it instructs the model
QWEN = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' }}
{{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}' }}
{{- '\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{%- if call.function.arguments is string %}{{- call.function.arguments }}
{%- else %}{{- call.function.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Mistral's v3 tokenizer format (Mixtral-8x22B-Instruct): tools before the last user turn, calls as a JSON list with
# 9-character ids, results with their call's id; a system turn goes in front of the last user turn
MISTRAL = """
{%- if messages[0].role == 'system' %}
{%- set system = messages[0].content %}{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system = none %}{%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in loop_messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.index0 == ns.last_user %}
{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- if system and loop.index0 == ns.last_user %}
{{- '[INST] ' + system + '\\n\\n' + message.content + '[/INST]' }}
{%- else %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for call in message.tool_calls %}
{%- if call.id | length != 9 %}{{- raise_exception('tool call ids must be 9 alphanumeric characters') }}{%- endif %}
{{- '{"name": "' + call.function.name + '", "arguments": ' }}
{%- if call.function.arguments is string %}{{- call.function.arguments }}
{%- else %}{{- call.function.arguments | tojson }}{%- endif %}
{{- ', "id": "' + call.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message.role == 'assistant' %}
{{- ' ' + message.content + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS] {"content": ' + (message.content | tojson) + ', "call_id": "' + message.tool_call_id + '"}' }}
{{- '[/TOOL_RESULTS]' }}
{%- else %}
{{- raise_exception('roles are system (first), user, assistant and tool') }}
{%- endif %}
{%- endfor %}
"""

# Qwen3.5's and Qwen3-Coder's format, in our words: the tools listed in the system turn, calls as XML, one parameter
# per element (strings as they are, other values as JSON), results as `<tool_response>` in a user turn; a generation
# prompt with thinking turned off writes the empty think block, as Qwen3's templates do
QWEN3_CODER = """
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nThese functions are available:\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nTo call one, write:\n<tool_call>\n<function=NAME>\n<parameter=PARAMETER>\nVALUE\n' }}
{{- '</parameter>\n</function>\n</tool_call>\n\nA value that is not a string is written as JSON. Several calls ' }}
{{- 'may follow one another.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\n' + (message.content or '') }}
{%- for call in message.tool_calls %}
{%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n<function=' + call.function.name + '>\n' }}
{%- if call.function.arguments is mapping %}
{%- for name, value in call.function.arguments | items %}
{{- '<parameter=' + name + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' }}
{%- endfor %}
{%- else %}{{- call.function.arguments + '\n' }}
{%- endif %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

# GLM-4.5's shape: [gMASK]<sop>, role tags without closing tags, tools listed in a system turn, calls as
# <tool_call>NAME then <arg_key>/<arg_value> pairs (strings as they are, other values as JSON), results in an
# <|observation|> turn, reasoning in <think> (an empty block when thinking is switched off). The instructions are
# edgemoe's own words, not GLM's
GLM = """
{{- '[gMASK]<sop>' }}
{%- if tools %}
{{- '<|system|>\\n# Tools\\n\\nThese functions are available, described inside <tools></tools>:\\n<tools>\\n' }}
{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}
{{- '</tools>\\n\\nTo call one, write its name and each argument in this form:\\n<tool_call>{function-name}\\n' }}
{{- '<arg_key>{arg-key}</arg_key>\\n<arg_value>{arg-value}</arg_value>\\n</tool_call>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|assistant|>\\n<think>' + (message.reasoning_content or '') + '</think>' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>' + call.function.name + '\\n' }}
{%- for key, value in call.function.arguments | items %}
{{- '<arg_key>' + key + '</arg_key>\\n<arg_value>' + (value if value is string else value | tojson) }}
{{- '</arg_value>\\n' }}
{%- endfor %}
{{- '</tool_call>' }}
{%- endfor %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|observation|>' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- else %}
{{- '<|' + message.role + '|>\\n' + message.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|assistant|>' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '\\n<think></think>' }}{%- endif %}
{%- endif %}
"""

# gpt-oss's harmony shape, in edgemoe's words: every message `<|start|>ROLE<|channel|>C<|message|>TEXT<|end|>`; a
# system header naming the reasoning effort (`reasoning_effort`: low, medium or high) and the channels; the caller's
# system messages and the tools (a `functions` namespace, parameters as JSON) in a developer message; an assistant's
# reasoning on the analysis channel (only after the last user message: earlier turns' reasoning is dropped), its text
# on final (commentary when calls follow it), each call on commentary addressed `to=functions.NAME` with JSON
# arguments and ending in <|call|>; results from `functions.NAME to=assistant`. Markup in a message's text, or an
# effort it does not know, is refused, naming the field
HARMONY = """
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort is not none else 'medium' %}
{%- if effort not in ['low', 'medium', 'high'] %}
{{- raise_exception('reasoning_effort: must be low, medium or high, not ' + (effort | string)) }}
{%- endif %}
{%- set marks = ['<|start|>', '<|channel|>', '<|message|>', '<|end|>', '<|return|>', '<|call|>', '<|constrain|>'] %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}
{%- set i = loop.index0 %}
{%- if m.role == 'user' %}{%- set ns.last_user = i %}{%- endif %}
{%- for field in ['content', 'reasoning_content'] %}
{%- for mark in marks %}
{%- if m[field] is string and mark in m[field] %}
{{- raise_exception('messages.' + (i | string) + '.' + field + ': harmony markup (' + mark + ') cannot be '
                    + 'sent as text') }}
{%- endif %}
{%- endfor %}
{%- endfor %}
{%- endfor %}
{{- '<|start|>system<|message|>An assistant answering in the harmony format.\nReasoning: ' + effort + '\n\n' }}
{{- '# Valid channels: analysis, commentary, final. Every message names its channel.' }}
{%- if tools %}{{- '\nCalls to the tools go to the commentary channel.' }}{%- endif %}
{{- '<|end|>' }}
{%- if (messages and messages[0].role == 'system') or tools %}
{{- '<|start|>developer<|message|>' }}
{%- if messages and messages[0].role == 'system' %}{{- '# Instructions\n\n' + messages[0].content }}{%- endif %}
{%- if tools %}
{%- if messages and messages[0].role == 'system' %}{{- '\n\n' }}{%- endif %}
{{- '# Tools\n\n## functions\n\nnamespace functions {\n' }}
{%- for tool in tools %}
{{- '\n// ' + (tool.function.description or '') + '\ntype ' + tool.function.name + ' = (_: ' }}
{{- (tool.function.parameters or {}) | tojson + ') => any;\n' }}
{%- endfor %}
{{- '\n} // namespace functions' }}
{%- endif %}
{{- '<|end|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}
{{- '<|start|>developer<|message|># Instructions\n\n' + message.content + '<|end|>' }}
{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
{%- elif message.role == 'assistant' %}
{%- if message.reasoning_content and loop.index0 > ns.last_user %}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.reasoning_content + '<|end|>' }}
{%- endif %}
{%- if message.content %}
{{- '<|start|>assistant<|channel|>' + ('commentary' if message.tool_calls else 'final') + '<|message|>' }}
{{- message.content + '<|end|>' }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{{- '<|start|>assistant<|channel|>commentary to=functions.' + call.function.name + ' <|constrain|>json<|message|>' }}
{{- (call.function.arguments if call.function.arguments is string else call.function.arguments | tojson) }}
{{- '<|call|>' }}
{%- endfor %}
{%- elif message.role == 'tool' %}
{{- '<|start|>functions.' + message.name + ' to=assistant<|channel|>commentary<|message|>' + message.content }}
{{- '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""

TEMPLATES = {"qwen": QWEN, "mistral": MISTRAL, "qwen3_coder": QWEN3_CODER, "glm": GLM, "harmony": HARMONY}


def chat_template(tool_format: str) -> str:
    """The chat template (jinja source) of random checkpoints whose family writes tool calls in `tool_format` (its
    `TOOL_FORMAT`)."""
    return TEMPLATES[tool_format].strip()
