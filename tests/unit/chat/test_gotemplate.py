"""llmrun.chat.gotemplate: Ollama's Go text/template chat templates.

The template fixtures are copied from Ollama (template/*.gotmpl, the tool templates of its
former server/testdata/tools, the llama3.1 library template), and most expected outputs are
Ollama's own test data for them.
"""

from __future__ import annotations

import json
from datetime import date

import pytest

from llmrun.chat import gotemplate, templatelimits, templates
from llmrun.chat.gotemplate import execute, looks_like_go, render
from llmrun.chat.templates import TemplateError

# -- fixtures: Ollama's templates ---------------------------------------------------------------

CHATML = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
    "{{ end }}<|im_start|>assistant\n"
)
LLAMA3_INSTRUCT = (
    "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
    "{{ .Content }}<|eot_id|>\n"
    "{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
)
MISTRAL_INSTRUCT = (
    "[INST] {{ range $index, $_ := .Messages }}\n"
    '{{- if eq .Role "system" }}{{ .Content }}\n\n'
    '{{ else if eq .Role "user" }}{{ .Content }}[/INST]\n'
    '{{- else if eq .Role "assistant" }} {{ .Content }}</s>[INST] {{ end }}\n'
    "{{- end }}"
)
GEMMA3_INSTRUCT = (
    "{{- range $i, $_ := .Messages }}\n"
    "{{- $last := eq (len (slice $.Messages $i)) 1 }}\n"
    '{{- if eq .Role "user" }}<start_of_turn>user\n'
    "{{- if and (eq $i 1) $.System }}\n{{ $.System }}\n{{ end }}\n"
    "{{ .Content }}<end_of_turn>\n"
    '{{ else if eq .Role "assistant" }}<start_of_turn>model\n'
    "{{ .Content }}<end_of_turn>\n{{ end }}\n"
    "{{- if $last }}<start_of_turn>model\n{{ end }}\n"
    "{{- end }}\n"
)
ALPACA = (
    '{{- $system := "" }}\n'
    "{{- range .Messages }}\n"
    '{{- if eq .Role "system" }}\n'
    "{{- if not $system }}{{ $system = .Content }}\n"
    '{{- else }}{{ $system = printf "%s\\n\\n%s" $system .Content }}\n'
    "{{- end }}\n"
    '{{- else if eq .Role "user" }}\n'
    "{{- if $system }}{{ $system }}\n\n"
    '{{ $system = "" }}\n'
    "{{- end }}### Instruction:\n{{ .Content }}\n\n"
    '{{ else if eq .Role "assistant" }}### Response:\n{{ .Content }}\n\n'
    "{{ end }}\n"
    "{{- end }}### Response:\n"
)
# server/testdata/tools/mistral.gotmpl (Ollama before v0.6.8)
MISTRAL_TOOLS = (
    "{{- range $index, $_ := .Messages }}\n"
    '{{- if eq .Role "user" }}\n'
    "{{- if and (eq (len (slice $.Messages $index)) 1) $.Tools }}"
    "[AVAILABLE_TOOLS] {{ $.Tools }}[/AVAILABLE_TOOLS]\n"
    "{{- end }}[INST] {{ if and (eq (len (slice $.Messages $index)) 1) $.System }}"
    "{{ $.System }}\n\n{{ end }}{{ .Content }}[/INST]\n"
    '{{- else if eq .Role "assistant" }}\n'
    "{{- if .Content }} {{ .Content }}</s>\n"
    "{{- else if .ToolCalls }}[TOOL_CALLS] [\n"
    '{{- range .ToolCalls }}{"name": "{{ .Function.Name }}", '
    '"arguments": {{ .Function.Arguments }}}\n'
    "{{- end }}]</s>\n"
    "{{- end }}\n"
    '{{- else if eq .Role "tool" }}[TOOL_RESULTS] {"content": {{ .Content }}}[/TOOL_RESULTS]\n'
    "{{- end }}\n"
    "{{- end }}"
)
# server/testdata/tools/llama3-groq-tool-use.gotmpl: prints `{{ .Function }}`, and falls back
# to .System/.Prompt/.Response without messages
LLAMA3_GROQ_TOOLS = """{{- if .Messages }}
{{- if or .System .Tools }}<|start_header_id|>system<|end_header_id|>

{{ .System }}
{{- if .Tools }} You are provided with function signatures within <tools></tools> XML tags. \
You may call one or more functions to assist with the user query. Don't make assumptions about \
what values to plug into functions. For each function call return a json object with function \
name and arguments within <tool_call></tool_call> XML tags as follows:
<tool_call>
{"name": <function-name>,"arguments": <args-dict>}
</tool_call>

Here are the available tools:
<tools>
{{- range .Tools }} {{ .Function }}
{{- end }} </tools>
{{- end }}
{{- end }}<|eot_id|>
{{- range .Messages }}
{{- if ne .Role "system" }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ if eq .Role "user" }}{{ .Content }}
{{- else if eq .Role "assistant" }}
{{- if .Content }}{{ .Content }}
{{- else if .ToolCalls }}<tool_call>
{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}
{{- end }}
</tool_call>
{{- end }}
{{- else if eq .Role "tool" }}<tool_response>
{{ .Content }}
</tool_response>
{{- end }}<|eot_id|>
{{- end }}
{{- end }}<|start_header_id|>assistant<|end_header_id|>

{{ else }}
{{ if .System }}<|start_header_id|>system<|end_header_id|>

{{ .System }}<|eot_id|>{{ end }}{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>

{{ .Prompt }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>

{{ end }}{{ .Response }}
{{- if .Response }}<|eot_id|>
{{- end }}"""
# ollama.com/library/llama3.1
LLAMA31 = """{{- if or .System .Tools }}<|start_header_id|>system<|end_header_id|>
{{- if .System }}

{{ .System }}
{{- end }}
{{- if .Tools }}

Cutting Knowledge Date: December 2023

When you receive a tool call response, use the output to format an answer to the orginal user \
question.

You are a helpful assistant with tool calling capabilities.
{{- end }}<|eot_id|>
{{- end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>
{{- if and $.Tools $last }}

Given the following functions, please respond with a JSON for a function call with its proper \
arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its \
value}. Do not use variables.

{{ range $.Tools }}
{{- . }}
{{ end }}
{{ .Content }}<|eot_id|>
{{- else }}

{{ .Content }}<|eot_id|>
{{- end }}{{ if $last }}<|start_header_id|>assistant<|end_header_id|>

{{ end }}
{{- else if eq .Role "assistant" }}<|start_header_id|>assistant<|end_header_id|>
{{- if .ToolCalls }}
{{ range .ToolCalls }}
{"name": "{{ .Function.Name }}", "parameters": {{ .Function.Arguments }}}{{ end }}
{{- else }}

{{ .Content }}
{{- end }}{{ if not $last }}<|eot_id|>{{ end }}
{{- else if eq .Role "tool" }}<|start_header_id|>ipython<|end_header_id|>

{{ .Content }}<|eot_id|>{{ if $last }}<|start_header_id|>assistant<|end_header_id|>

{{ end }}
{{- end }}
{{- end }}"""
# A legacy template (template/template_test.go): no .Messages, one exchange at a time.
CHATML_LEGACY = (
    "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n"
    "{{ end }}{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n"
    "{{ end }}<|im_start|>assistant\n{{ .Response }}<|im_end|>\n"
)

# Ollama's template/template_test.go conversation (system-user-assistant-user)
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello, how are you?"},
    {"role": "assistant", "content": "I'm doing great. How can I help you today?"},
    {"role": "user", "content": "I'd like to show off how chat templating works!"},
]
U1, A1, U2 = (m["content"] for m in CONVERSATION[1:])

# server/testdata/tools/messages.json and tools.json
TOOL_CONVERSATION = [
    {"role": "system",
     "content": "You are a knowledgeable assistant. You can answer questions and perform tasks."},
    {"role": "user", "content": "What's the weather like today in Paris?"},
    {"role": "assistant", "tool_calls": [{
        "id": "89a1e453-0bce-4de3-a456-c54bed09c520", "type": "function",
        "function": {"name": "get_current_weather",
                     "arguments": {"location": "Paris, France", "format": "celsius"}}}]},
    {"role": "tool", "tool_call_id": "89a1e453-0bce-4de3-a456-c54bed09c520", "content": "22"},
    {"role": "assistant",
     "content": "The current temperature in Paris, France is 22 degrees Celsius."},
    {"role": "user", "content": "What's the weather like today in San Francisco and Toronto?"},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_current_weather", "description": "Get the current weather",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string",
                     "description": "The city and state, e.g. San Francisco, CA"},
        "format": {"type": "string", "enum": ["celsius", "fahrenheit"],
                   "description": "The temperature unit to use. Infer this from the user's "
                                  "location."}},
        "required": ["location", "format"]}}}]
# How Ollama prints that tool: struct field order, but the properties map's keys sorted
FUNCTION_JSON = (
    '{"name":"get_current_weather","description":"Get the current weather","parameters":'
    '{"type":"object","required":["location","format"],"properties":{"format":{"type":"string",'
    '"description":"The temperature unit to use. Infer this from the user\'s location.",'
    '"enum":["celsius","fahrenheit"]},"location":{"type":"string",'
    '"description":"The city and state, e.g. San Francisco, CA"}}}}'
)
TOOL_JSON = '{"type":"function","function":' + FUNCTION_JSON + "}"


# -- Ollama's templates, Ollama's expected output -----------------------------------------------


@pytest.mark.parametrize(("source", "expected"), [
    (CHATML,
     "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
     f"<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n{A1}<|im_end|>\n"
     f"<|im_start|>user\n{U2}<|im_end|>\n<|im_start|>assistant\n"),
    (LLAMA3_INSTRUCT,
     "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
     f"<|start_header_id|>user<|end_header_id|>\n\n{U1}<|eot_id|>"
     f"<|start_header_id|>assistant<|end_header_id|>\n\n{A1}<|eot_id|>"
     f"<|start_header_id|>user<|end_header_id|>\n\n{U2}<|eot_id|>"
     "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    (MISTRAL_INSTRUCT,
     f"[INST] You are a helpful assistant.\n\n{U1}[/INST] {A1}</s>[INST] {U2}[/INST]"),
    (GEMMA3_INSTRUCT,
     f"<start_of_turn>user\nYou are a helpful assistant.\n\n{U1}<end_of_turn>\n"
     f"<start_of_turn>model\n{A1}<end_of_turn>\n<start_of_turn>user\n{U2}<end_of_turn>\n"
     "<start_of_turn>model\n\n"),
    (ALPACA,
     f"You are a helpful assistant.\n\n### Instruction:\n{U1}\n\n### Response:\n{A1}\n\n"
     f"### Instruction:\n{U2}\n\n### Response:\n"),
], ids=["chatml", "llama3-instruct", "mistral-instruct", "gemma3-instruct", "alpaca"])
def test_ollama_templates(source: str, expected: str) -> None:
    assert render(source, CONVERSATION) == expected


def test_first_turn() -> None:
    assert render(GEMMA3_INSTRUCT, CONVERSATION[1:2]) == (
        f"<start_of_turn>user\n{U1}<end_of_turn>\n<start_of_turn>model\n\n")
    assert render(MISTRAL_INSTRUCT, CONVERSATION[1:2]) == f"[INST] {U1}[/INST]"


def test_mistral_tools() -> None:
    assert render(MISTRAL_TOOLS, TOOL_CONVERSATION, tools=TOOLS) == (
        "[INST] What's the weather like today in Paris?[/INST][TOOL_CALLS] "
        '[{"name": "get_current_weather", "arguments": {"format":"celsius",'
        '"location":"Paris, France"}}]</s>[TOOL_RESULTS] {"content": 22}[/TOOL_RESULTS] '
        "The current temperature in Paris, France is 22 degrees Celsius.</s>"
        f"[AVAILABLE_TOOLS] [{TOOL_JSON}][/AVAILABLE_TOOLS][INST] You are a knowledgeable "
        "assistant. You can answer questions and perform tasks.\n\n"
        "What's the weather like today in San Francisco and Toronto?[/INST]"
    )


def test_llama3_groq_tools() -> None:
    assert render(LLAMA3_GROQ_TOOLS, TOOL_CONVERSATION, tools=TOOLS) == (
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a knowledgeable assistant. You "
        "can answer questions and perform tasks. You are provided with function signatures "
        "within <tools></tools> XML tags. You may call one or more functions to assist with the "
        "user query. Don't make assumptions about what values to plug into functions. For each "
        "function call return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
        '{"name": <function-name>,"arguments": <args-dict>}\n</tool_call>\n\n'
        f"Here are the available tools:\n<tools> {FUNCTION_JSON} </tools><|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat's the weather like today in Paris?"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<tool_call>\n"
        '{"name": "get_current_weather", "arguments": {"format":"celsius",'
        '"location":"Paris, France"}}\n</tool_call><|eot_id|>'
        "<|start_header_id|>tool<|end_header_id|>\n\n<tool_response>\n22\n</tool_response>"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nThe current temperature in "
        "Paris, France is 22 degrees Celsius.<|eot_id|><|start_header_id|>user<|end_header_id|>"
        "\n\nWhat's the weather like today in San Francisco and Toronto?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama31_tools() -> None:
    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {
            "name": "get_current_weather",
            "arguments": '{"location": "Paris, France", "format": "celsius"}'}}]},
        {"role": "tool", "content": "22"},
        {"role": "assistant", "content": "It is 22 degrees Celsius in Paris."},
        {"role": "user", "content": "And in Toronto?"},
    ]
    assert render(LLAMA31, messages, tools=TOOLS) == (
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a weather bot.\n\n"
        "Cutting Knowledge Date: December 2023\n\nWhen you receive a tool call response, use the "
        "output to format an answer to the orginal user question.\n\nYou are a helpful assistant "
        "with tool calling capabilities.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_current_weather", "parameters": {"format":"celsius",'
        '"location":"Paris, France"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n22<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nIt is 22 degrees Celsius in Paris."
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, "
        "please respond with a JSON for a function call with its proper arguments that best "
        "answers the given prompt.\n\nRespond in the format {\"name\": function name, "
        '"parameters": dictionary of argument name and its value}. Do not use variables.\n\n'
        f"{TOOL_JSON}\n\nAnd in Toronto?<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
        "\n\n"
    )
    # without tools the same template is a plain Llama 3 chat; a last assistant turn stays open
    assert render(LLAMA31, [*messages[:2], {"role": "assistant", "content": "It is"}]) == (
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a weather bot.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nIt is"
    )


@pytest.mark.parametrize(("go", "jinja"), [
    (CHATML,
     "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
     " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
     "{{ '<|im_start|>assistant\n' }}{% endif %}"),
    (LLAMA3_INSTRUCT,
     "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
     "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
     "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
     "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
     "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
])
def test_same_text_as_the_jinja_template(go: str, jinja: str) -> None:
    assert render(go, CONVERSATION) == templates.render(jinja, CONVERSATION)


# -- templates without .Messages ------------------------------------------------------------------


def test_legacy_renders_each_exchange() -> None:
    assert render(CHATML_LEGACY, CONVERSATION) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n{A1}<|im_end|>\n"
        f"<|im_start|>user\n{U2}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("source", [
    "[INST] {{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}[/INST] ",
    "[INST] {{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}[/INST] {{ .Response }}",
])
def test_legacy_with_and_without_response(source: str) -> None:
    # template_test.go "mistral system": Ollama appends {{ .Response }} when it is missing
    messages = [{"role": "system", "content": "You are a helpful assistant!"},
                {"role": "user", "content": "Hello friend!"},
                {"role": "assistant", "content": "Hello human!"},
                {"role": "user", "content": "What is your name?"}]
    assert render(source, messages) == (
        "[INST] You are a helpful assistant!\n\nHello friend![/INST] Hello human!"
        "[INST] What is your name?[/INST] "
    )


def test_legacy_last_assistant_message_is_continued() -> None:
    messages = [{"role": "user", "content": "Hello friend!"},
                {"role": "assistant", "content": "Hello human!"},
                {"role": "user", "content": "What is your name?"},
                {"role": "assistant", "content": "My name is Ollama and I"}]
    expected = ("[INST] Hello friend![/INST] Hello human![INST] What is your name?[/INST] "
                "My name is Ollama and I")
    assert render("[INST] {{ .Prompt }}[/INST] ", messages) == expected
    assert render("[INST] {{ .Prompt }}[/INST] {{ .Response }}</s>", messages) == (
        "[INST] Hello friend![/INST] Hello human!</s>[INST] What is your name?[/INST] "
        "My name is Ollama and I")
    # the cut comes after the first .Response: whatever follows is the model's to write
    assert render(CHATML_LEGACY, messages[:2]) == (
        "<|im_start|>user\nHello friend!<|im_end|>\n<|im_start|>assistant\nHello human!")


def test_legacy_without_generation_prompt_closes_the_last_exchange() -> None:
    messages = CONVERSATION[:3]
    assert render(CHATML_LEGACY, messages, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n{A1}<|im_end|>\n"
    )
    # with .Messages the template alone decides, as in Ollama
    assert render(CHATML, messages, add_generation_prompt=False) == render(CHATML, messages)


def test_legacy_sees_no_messages_or_tools() -> None:
    source = "{{ .System }}|{{ .Prompt }}|{{ if .Tools }}tools{{ end }}|{{ .Response }}"
    assert render(source, CONVERSATION, tools=TOOLS) == (
        f"You are a helpful assistant.|{U1}||{A1}|{U2}||")


# -- Ollama's data model ------------------------------------------------------------------------


def test_collate_merges_consecutive_messages_and_joins_system() -> None:
    messages = [{"role": "system", "content": "A"}, {"role": "User", "content": "x"},
                {"role": "user", "content": "y"}, {"role": "system", "content": "B"},
                {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    source = "{{ .System }}|{{ range .Messages }}{{ .Role }}={{ .Content }};{{ end }}"
    assert render(source, messages) == "A\n\nB|system=A;user=x\n\ny;system=B;tool=1;tool=2;"


def test_message_fields() -> None:
    messages = [
        {"role": "assistant", "content": None, "thinking": "hmm", "tool_calls": [{
            "id": "c1", "function": {"name": "f", "arguments": {"n": 3, "s": "x<y", "z": [1.5]}}}]},
        {"role": "tool", "content": "r1", "name": "f", "tool_call_id": "c1"},
        {"role": "tool", "content": "r2", "tool_name": "g"},
    ]
    source = (
        "{{ range .Messages }}{{ .Role }}|{{ .Content }}|{{ .Thinking }}|{{ .ToolName }}|"
        "{{ .ToolCallID }}|{{ range .ToolCalls }}{{ .ID }} {{ .Function.Name }} "
        "{{ .Function.Arguments }} {{ .Function.Arguments.n }} "
        "{{ range $k, $v := .Function.Arguments }}{{ $k }}={{ $v }};{{ end }}{{ end }}\n{{ end }}"
    )
    assert render(source, messages) == (
        'assistant||hmm|||c1 f {"n":3,"s":"x\\u003cy","z":[1.5]} 3 n=3;s=x<y;z=[1.5];\n'
        "tool|r1||f|c1|\ntool|r2||g||\n"
    )
    assert render("{{ range .Messages }}{{ json . }}{{ end }}", messages[2:]) == (
        '{"Role":"tool","Content":"r2","Thinking":"","Images":null,"ToolCalls":null,'
        '"ToolName":"g","ToolCallID":""}')


def test_tool_fields_and_json() -> None:
    source = (
        "{{ range .Messages }}{{ end }}{{ range .Tools }}{{ .Type }} {{ .Function.Name }}: "
        "{{ .Function.Description }} {{ .Function.Parameters.Required }}\n"
        "{{ range $name, $p := .Function.Parameters.Properties }}{{ $name }} {{ $p.Type }} "
        "{{ $p.Enum }} {{ $p.Description }}\n{{ end }}{{ json . }}\n{{ . }}\n{{ end }}{{ .Tools }}"
    )
    assert render(source, CONVERSATION, tools=TOOLS) == (
        "function get_current_weather: Get the current weather [location format]\n"
        "format string [celsius fahrenheit] The temperature unit to use. Infer this from the "
        "user's location.\nlocation string [] The city and state, e.g. San Francisco, CA\n"
        f"{TOOL_JSON}\n{TOOL_JSON}\n[{TOOL_JSON}]"
    )


def test_tool_schema_keeps_only_ollamas_fields() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "additionalProperties": False, "properties": {"a": {
            "type": ["string", "null"], "title": "A", "default": 1,
            "properties": {"z": {"type": "integer"}, "y": {"type": "boolean"}}}}}}}]
    assert render("{{ .Messages }}{{ range .Tools }}{{ . }}{{ end }}", [], tools=tools) == (
        '[]{"type":"function","function":{"name":"f","description":"","parameters":{"type":'
        '"object","properties":{"a":{"type":["string","null"],"properties":{"z":{"type":'
        '"integer"},"y":{"type":"boolean"}}}}}}}'
    )
    assert render("{{ .Messages }}{{ .Tools }}", []) == "[]null"


def test_think_values() -> None:
    source = "{{ .Messages }}{{ .Think }} {{ .IsThinkSet }} {{ .ThinkLevel }}"
    assert render(source, []) == "[]false false "
    assert render(source, [], think=True) == "[]true true medium"
    assert render(source, [], think=False) == "[]false true "
    assert render(source, [], think="high") == "[]true true high"


def test_current_date() -> None:
    source = "{{ .Messages }}{{ currentDate }}"
    assert render(source, []) == "[]" + date.today().isoformat()


# -- the interpreter --------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "expected"), [
    ("a  {{- 1 -}}  b", "a1b"),
    ("a {{-3}} b", "a -3 b"),
    ("a\n{{- if true -}}\n  b  \n{{- end -}}\n c", "abc"),
    ("x {{- /* a comment */ -}} y", "xy"),
    ("x {{/* a\ncomment */}} y", "x  y"),
])
def test_text_trim_markers_and_comments(source: str, expected: str) -> None:
    assert execute(source, {}) == expected


@pytest.mark.parametrize(("source", "expected"), [
    ('{{ "a\\tb\\x41\\u00e9\\101\\"" }}', 'a\tbAéA"'),
    ("{{ `raw\\n` }}", "raw\\n"),
    ("{{ 'a' }} {{ 0x1F }} {{ 1_000 }} {{ 017 }} {{ -2 }}", "97 31 1000 15 -2"),
    ("{{ 1.5 }} {{ 1e6 }} {{ 100000.0 }} {{ 0.00001 }} {{ 3.0 }} {{ .5 }}",
     "1.5 1e+06 100000 1e-05 3 0.5"),
    ("{{ true }} {{ false }}", "true false"),
    ("{{ .L }} {{ .M }} {{ $ }}", "[1 a <nil>] map[k:[1]] map[L:[1 a <nil>] M:map[k:[1]]]"),
    ("{{ .Missing }}|{{ print .Missing }}", "<no value>|<nil>"),
])
def test_literals_and_printing(source: str, expected: str) -> None:
    assert execute(source, {"L": [1, "a", None], "M": {"k": [1]}}) == expected


def test_fields_variables_and_scopes() -> None:
    data = {"A": {"B": {"C": "deep"}}, "L": [{"N": "n"}], "S": "abc"}
    assert execute("{{ .A.B.C }} {{ $.A.B.C }} {{ (index .L 0).N }} {{ $x := .A }}{{ $x.B.C }}",
                   data) == "deep deep n deep"
    assert execute("{{ with .A.B }}{{ .C }} {{ $.S }}{{ end }}", data) == "deep abc"
    # `=` assigns an outer variable; `:=` inside a block ends with it
    assert execute("{{ $x := 1 }}{{ if true }}{{ $x = 2 }}{{ $y := 3 }}{{ $y }}{{ end }}{{ $x }}",
                   {}) == "32"
    assert execute('{{ $s := "" }}{{ range .L }}{{ $s = printf "%s%s" $s .N }}{{ end }}{{ $s }}',
                   {"L": [{"N": "a"}, {"N": "b"}]}) == "ab"


def test_range() -> None:
    data = {"L": ["a", "b"], "E": [], "M": {"b": 1, "a": 2}, "N": [1, 2, 3, 4, 5]}
    assert execute("{{ range $i, $v := .L }}{{ $i }}={{ $v }};{{ end }}", data) == "0=a;1=b;"
    assert execute("{{ range $v := .L }}{{ $v }}{{ end }}{{ range .L }}{{ . }}{{ end }}",
                   data) == "abab"
    assert execute("{{ range .E }}x{{ else }}empty{{ end }}", data) == "empty"
    assert execute("{{ range .Missing }}x{{ else }}nil{{ end }}", data) == "nil"
    assert execute("{{ range $k, $v := .M }}{{ $k }}:{{ $v }},{{ end }}", data) == "a:2,b:1,"
    assert execute("{{ range 3 }}{{ . }}{{ end }}", data) == "012"
    assert execute("{{ range .N }}{{ if eq . 2 }}{{ continue }}{{ end }}"
                   "{{ if eq . 4 }}{{ break }}{{ end }}{{ . }}{{ end }}",
                   {"N": [1, 2, 3, 4, 5]}) == "13"


def test_if_with_else_chains() -> None:
    source = '{{ if eq .A 1 }}one{{ else if eq .A 2 }}two{{ else }}other{{ end }}'
    assert [execute(source, {"A": a}) for a in (1, 2, 3)] == ["one", "two", "other"]
    source = "{{ with .X }}[{{ . }}]{{ else with .Y }}<{{ . }}>{{ else }}none{{ end }}"
    assert execute(source, {"X": "x"}) == "[x]"
    assert execute(source, {"Y": "y"}) == "<y>"
    assert execute(source, {"X": "", "Y": 0}) == "none"


@pytest.mark.parametrize(("value", "truth"), [
    ("", False), ("x", True), (0, False), (2, True), (0.0, False), ([], False), ([0], True),
    ({}, False), ({"k": 1}, True), (None, False), (False, False), (True, True),
])
def test_truthiness(value: object, truth: bool) -> None:
    assert execute("{{ if .V }}t{{ else }}f{{ end }}", {"V": value}) == ("t" if truth else "f")


def test_comparisons_and_logic() -> None:
    assert execute('{{ eq .A 1 2 3 }} {{ ne "a" "b" }} {{ lt 1 2 }} {{ le 2 2 }} '
                   '{{ gt "b" "a" }} {{ ge 1.5 2.5 }} {{ eq .Missing "x" }}',
                   {"A": 3}) == "true true true true true false false"
    assert execute('{{ and 1 0 2 }} {{ or 0 "" "x" }} {{ and 1 2 }} {{ not 0 }} {{ not "a" }}',
                   {}) == "0 x 2 true false"
    # and/or stop early, as Go's do
    assert execute("{{ or .X (index .Missing 5) }}", {"X": 1}) == "1"


def test_functions() -> None:
    data = {"L": [1, 2, 3], "M": {"a": "A"}, "S": "héllo"}
    assert execute("{{ len .S }} {{ len .L }} {{ len .M }} {{ index .L 1 }} {{ index .M \"a\" }} "
                   "{{ slice .L 1 }} {{ slice .L 1 2 }} {{ slice \"hello\" 1 3 }}",
                   data) == "6 3 1 2 A [2 3] [2] el"
    assert execute('{{ print 1 2 "a" "b" 3 }}|{{ println 1 "a" }}|{{ "x" | printf "%s-%s" "y" }}'
                   "|{{ .S | len }}|{{ (len .L) }}", data) == "1 2ab3|1 a\n|y-x|6|3"
    assert execute('{{ html "<a href=\'x\'>&\\"" }} {{ js "it\'s <b>\\n" }} '
                   '{{ urlquery "a b&c/d" }}', {}) == (
        "&lt;a href=&#39;x&#39;&gt;&amp;&#34; it\\'s \\u003Cb\\u003E\\u000A a+b%26c%2Fd")
    assert execute('{{ json .M }} {{ json "<&>" }} {{ json 1.0 }} {{ json .N }}',
                   {"M": {"b": [1, None, True], "a": "é"}, "N": None}) == (
        '{"a":"é","b":[1,null,true]} "\\u003c\\u0026\\u003e" 1 null')


@pytest.mark.parametrize(("source", "expected"), [
    ('{{ printf "%s=%d %v %q %t %%" "k" 42 true "hi\\n" false }}', 'k=42 true "hi\\n" false %'),
    ('{{ printf "%5.2f|%x|%X|%c|%e" 3.14159 255 "hi" 65 1000.0 }}',
     " 3.14|ff|6869|A|1.000000e+03"),
    ('{{ printf "%05d|%-4d|%+d|%6s|%-3s|" 42 7 3 "ab" "c" }}', "00042|7   |+3|    ab|c  |"),
    ('{{ printf "%v %v" .L .M }}', "[1 a] map[k:1]"),
    ('{{ printf "%d" "s" }} {{ printf "%s" }} {{ printf "x" 1 }} {{ printf "%d" nil }}',
     "%!d(string=s) %!s(MISSING) x%!(EXTRA int=1) %!d(<nil>)"),
])
def test_printf(source: str, expected: str) -> None:
    assert execute(source, {"L": [1, "a"], "M": {"k": 1}}) == expected


# -- errors and limits ------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "message"), [
    ("{{ .X ", "unclosed action"),
    ("{{ .X }", "unexpected '}'"),
    ('{{ "abc }}', "unterminated quoted string"),
    ("{{ if .X }}", "has no {{end}}"),
    ("{{ range .X }}{{ else }}", "expected {{end}} to close {{range}}"),
    ("{{ end }}", "unexpected {{end}}"),
    ("{{ else }}", "unexpected {{else}}"),
    ("{{ }}", "missing value for command"),
    ("{{ if }}{{ end }}", "missing value for if"),
    ("{{ $z }}", "undefined variable '$z'"),
    ("{{ $z = 1 }}", "undefined variable '$z'"),
    ("{{ if true }}{{ $y := 3 }}{{ end }}{{ $y }}", "undefined variable '$y'"),
    ("{{ foo 1 }}", "function 'foo' not defined"),
    ("{{ break }}", "{{break}} outside {{range}}"),
    ("{{ range .L }}{{ else }}{{ continue }}{{ end }}", "{{continue}} outside {{range}}"),
    ("{{ nil }}", "nil is not a command"),
    ("{{ 1 | 2 }}", "non executable command in pipeline stage 2"),
    ("{{ .X.Y\"a\" }}", "in operand"),
    ("{{ (.X }}", "unclosed left paren"),
    ("{{ .X) }}", "unexpected ')'"),
    ("{{ /* x */ }}", "unexpected '/'"),
    ("{{/* x */ .Y }}", "comment ends before closing delimiter"),
    ('{{ template "x" }}', "{{template}} is not supported"),
    ("{{ 08 }}", "bad number syntax"),
    ('{{ "\\q" }}', "unknown escape sequence"),
])
def test_syntax_errors(source: str, message: str) -> None:
    with pytest.raises(TemplateError, match="line 1") as info:
        execute(source, {})
    assert message in str(info.value)


@pytest.mark.parametrize(("source", "message"), [
    ("{{ .A.B.C }}", "nil pointer evaluating interface {}.C"),
    ("{{ .L.X }}", "can't evaluate field X in type []interface {}"),
    ("{{ .X 1 }}", "can't give argument to non-function .X"),
    ('{{ "a" "b" }}', "can't give argument to non-function 'a'"),
    ("{{ eq 1 1.0 }}", "incompatible types for comparison"),
    ('{{ eq 1 "a" }}', "incompatible types for comparison"),
    ("{{ eq .L .L }}", "non-comparable types"),
    ("{{ lt true false }}", "invalid type for comparison"),
    ("{{ index .L 5 }}", "index out of range: 5"),
    ("{{ index .L 1.5 }}", "cannot index slice/array with type float64"),
    ("{{ slice .L 1 0 }}", "invalid slice index: 1 > 0"),
    ('{{ range "abc" }}{{ end }}', "range can't iterate over abc"),
    ("{{ len 3 }}", "len of type int"),
    ("{{ not 1 2 }}", "wrong number of args for not: want 1 got 2"),
    ("{{ eq 1 }}", "wrong number of args for eq: want at least 2 got 1"),
    ("{{ printf 1 }}", "wrong type for value; expected string; got int"),
])
def test_execution_errors(source: str, message: str) -> None:
    with pytest.raises(TemplateError, match="line 1") as info:
        execute(source, {"A": {}, "L": [1], "X": 1})
    assert message in str(info.value)


def test_error_names_the_line() -> None:
    with pytest.raises(TemplateError, match="line 3: can't evaluate field Nope"):
        render("{{ range .Messages }}\n{{ .Role }}\n{{ .Nope }}{{ end }}", CONVERSATION)


def test_no_python_attributes() -> None:
    assert render("{{ .__class__ }}{{ .Messages }}", []) == "<no value>[]"
    for source in ("{{ range .Messages }}{{ .__class__ }}{{ end }}",
                   "{{ range .Messages }}{{ .Content.__len__ }}{{ end }}",
                   "{{ with .Messages }}{{ (index . 0).__dict__ }}{{ end }}"):
        with pytest.raises(TemplateError, match="can't evaluate field"):
            render(source, CONVERSATION)


def test_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(templatelimits, "MAX_STEPS", 10_000)
        with pytest.raises(TemplateError, match="exceeds its limit of 10000 steps"):
            execute("{{ range 100000000 }}{{ end }}", {})
    with pytest.raises(TemplateError, match="output exceeds its limit of 10485760 characters"):
        execute("{{ range 2000 }}{{ $.S }}{{ end }}", {"S": "x" * 10_000})
    with pytest.raises(TemplateError, match="print makes a string over its limit"):
        execute('{{ $s := "xxxxxxxxxxxxxxxx" }}{{ range 30 }}{{ $s = print $s $s }}{{ end }}', {})
    with pytest.raises(TemplateError, match="nest deeper than the limit of 100"):
        execute("{{ if true }}" * 200 + "{{ end }}" * 200, {})
    with pytest.raises(TemplateError, match="nest deeper than the limit of 100"):
        execute("{{ " + "(" * 200 + "1" + ")" * 200 + " }}", {})
    deep: dict = {}
    for _ in range(5000):
        deep = {"a": deep}
    with pytest.raises(TemplateError):
        render("{{ range .Messages }}{{ range .ToolCalls }}{{ json . }}{{ end }}{{ end }}",
               [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                    "arguments": deep}}]}])


def test_nested_ranges_over_large_inputs_stop_at_the_step_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(templatelimits, "MAX_STEPS", 50_000)  # the real one takes a second to reach
    monkeypatch.setattr(templatelimits, "MAX_SECONDS", 3600.0)
    conversation = [{"role": ("user", "assistant")[i % 2], "content": str(i)}
                    for i in range(2000)]  # alternating: collate merges a role's runs
    with pytest.raises(TemplateError, match="exceeds its limit of 50000 steps"):
        render("{{ range .Messages }}{{ range $.Messages }}{{ range $.Messages }}{{ .Content }}"
               "{{ end }}{{ end }}{{ end }}", conversation)


def test_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(templatelimits, "MAX_SECONDS", -1.0)  # already past: the first clock check
    with pytest.raises(TemplateError, match="exceeds its time limit"):
        execute("{{ range 100000000 }}{{ end }}", {})


def test_many_wide_printf_verbs_stop_before_they_are_joined() -> None:
    source = '{{ printf "' + "%999999s" * 20 + '" ' + "1 " * 20 + "}}"
    with pytest.raises(TemplateError, match="printf makes a string over its limit"):
        execute(source, {})
    with pytest.raises(TemplateError, match="print makes a string over its limit"):
        execute("{{ print" + " $.S" * 20 + " }}", {"S": "x" * 1_000_000})


def test_source_size_limit() -> None:
    source = "{{ .Prompt }}" + " " * templatelimits.MAX_TEMPLATE_SIZE
    for run in (gotemplate.check, templates.check,
                lambda s: render(s, CONVERSATION), lambda s: templates.render(s, CONVERSATION)):
        with pytest.raises(TemplateError, match="over the limit of 131072"):
            run(source)


class _CountingSource(str):
    """A template source that tallies the characters `count` scans: the parser once counted
    lines from the start for every action, quadratic in the template's size."""

    scanned = 0

    def count(self, sub: str, start: int = 0, end: int | None = None) -> int:  # type: ignore
        stop = len(self) if end is None else end
        type(self).scanned += max(0, stop - start)
        return super().count(sub, start, end)


def test_parsing_is_linear_in_the_template_size() -> None:
    source = "line\n{{ .X }}" * 20_000  # 260 KB, 20,000 actions on 20,000 lines
    _CountingSource.scanned = 0
    nodes = gotemplate._Parser(_CountingSource(source)).parse()
    assert len(nodes) == 40_000 and nodes[-1].line == 20_001  # line numbers still right
    assert _CountingSource.scanned <= 2 * len(source)


def test_parser_variables_are_scoped() -> None:
    source = "{{ $a := 1 }}{{ if true }}{{ $b := 2 }}{{ $a }}{{ $b }}{{ end }}{{ $a }}"
    assert execute(source, {}) == "121"
    with pytest.raises(TemplateError, match="undefined variable '\\$b'"):
        execute(source + "{{ $b }}", {})


def test_bad_tool_call_arguments() -> None:
    calls = [{"function": {"name": "f", "arguments": "{not json"}}]
    with pytest.raises(TemplateError, match="not valid JSON"):
        render(CHATML, [{"role": "assistant", "content": "", "tool_calls": calls}])


# -- telling Go from Jinja ----------------------------------------------------------------------

JINJA_TEMPLATES = [
    templates.FALLBACK_TEMPLATE,
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{{- bos_token -}}\n{%- for message in messages -%}\n  {%- if message['role'] == 'assistant' "
    "-%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}\n"
    "  {{- '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' -}}\n"
    "{%- endfor -%}",
    "{{ bos_token }}{{ messages[0]['content'] }}{{ range(3) | list }}",
    "Hello {{ name }}",
]


@pytest.mark.parametrize("source", [CHATML, LLAMA3_INSTRUCT, MISTRAL_INSTRUCT, GEMMA3_INSTRUCT,
                                    ALPACA, MISTRAL_TOOLS, LLAMA3_GROQ_TOOLS, LLAMA31,
                                    CHATML_LEGACY, "{{ .Prompt }}", "{{- if .System }}x{{ end }}",
                                    "{{/* c */}}{{ $x := 1 }}"])
def test_looks_like_go(source: str) -> None:
    assert looks_like_go(source)


@pytest.mark.parametrize("source", JINJA_TEMPLATES)
def test_jinja_is_not_go(source: str) -> None:
    assert not looks_like_go(source)


def test_parsed_once() -> None:
    gotemplate._compile.cache_clear()
    for _ in range(3):
        render(CHATML, CONVERSATION)
    assert gotemplate._compile.cache_info().hits == 2
    assert json.loads(render("{{ if .Messages }}{{ end }}{{ json .Tools }}", [], tools=TOOLS)) == [
        {"type": "function", "function": json.loads(FUNCTION_JSON)}]


def test_a_past_thought_reaches_dot_thinking() -> None:
    from llmrun.chat.gotemplate import render as go_render

    source = "{{ range .Messages }}{{ .Role }}:{{ if .Thinking }}[{{ .Thinking }}]{{ end }}" \
             "{{ .Content }};{{ end }}"
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning_content": "greet back"}]
    assert go_render(source, msgs) == "user:hi;assistant:[greet back]hello;"
