"""Tool calls in every family's own format: exact parses, any cut of the text into pieces gives the whole
parse (arguments streamed incrementally), text that is not a call stays content, hostile text is linear."""

from __future__ import annotations

import json
import time

import pytest

from ondevice import toolcalls as TC

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"type": "string"}}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
PARIS = {"city": "Paris"}

# (family, model output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me check.", [("get_weather", PARIS), ("get_time", {"zone": "CET"})]),
    ("hermes", 'Sure.\n{"name": "get_time", "arguments": {"zone": "a\\"}{b"}}', "Sure.",
     [("get_time", {"zone": 'a"}{b'})]),  # Qwen2.5: the tags are special tokens that render as nothing
    ("hermes", '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>', None,
     [("get_weather", {"city": "Oslo"})]),
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [("get_time", {})]),
    ("hermes", 'I will call:\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', "I will call:",
     [("get_weather", PARIS)]),
    ("hermes", 'Two:\n```json\n{"name": "get_time", "arguments": {"zone": "CET"}}\n{"name": "get_time", "arguments": {}}\n```\n'
               "ok", "Two:\n\nok", [("get_time", {"zone": "CET"}), ("get_time", {})]),
    ("llama3", '```\n<|python_tag|>{"name": "get_time", "parameters": {}}\n{"x": 1}\n```', '{"x": 1}\n```',
     [("get_time", {})]),
    ("hermes", "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>",
     "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>", []),
    ("hermes", '{"answer": 42}\nplain', '{"answer": 42}\nplain', []),
    ("hermes", "a <tool_call> b", "a <tool_call> b", []),
    ("hermes", "```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    ("qwen3_coder", "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n</function>\n"
                    "</tool_call>", "I'll look.", [("get_weather", {"city": "New York", "days": 3, "tags": ["a", "b"]})]),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", None, [("get_time", {})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n<b>1</b> < 2\n</parameter>\n</function>"
                    "\n</tool_call>", None, [("get_weather", {"city": "<b>1</b> < 2"})]),
    ("qwen3_coder", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', None,
     [("get_time", {"zone": "UTC"})]),
    ("qwen3_coder", "<tool_call>\n<function=nope>\n</function>\n</tool_call>",
     "<tool_call>\n<function=nope>\n</function>\n</tool_call>", []),
    ("glm", "Let me see.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>[\"x\"]</arg_value>\n"
            "</tool_call>", "Let me see.", [("get_weather", {"city": "Paris", "days": 3, "tags": ["x"]})]),
    ("glm", "<tool_call>get_time\n</tool_call>", None, [("get_time", {})]),
    ("glm", "<tool_call>nope\n</tool_call>", "<tool_call>nope\n</tool_call>", []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", PARIS)]),
    ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "PST"}}', None,
     [("get_time", {"zone": "PST"})]),
    ("llama3", "The answer is {not a call}.", "The answer is {not a call}.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', None,
     [("get_weather", PARIS), ("get_time", {"zone": "CET"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', None,
     [("get_weather", PARIS), ("get_time", {"zone": "CET"})]),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', "Checking.",
     [("get_weather", PARIS)]),
    ("mistral", "[TOOL_CALLS]oops no args", "[TOOL_CALLS]oops no args", []),
    # a committed call whose JSON then breaks keeps its arguments as written; the rest is content
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"zone": "CET "x"}', 'x"}', [("get_time", None)]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "a"}<bad>}\n</tool_call>',
     "<bad>}\n</tool_call>", [("get_time", {"zone": "a"})]),
    ("mistral", 'Run:\n```\n{"name": "get_time", "arguments": {"zone": "CET"}}\n```', "Run:", [("get_time", {"zone": "CET"})]),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
                 '{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None,
     [("get_weather", PARIS), ("get_time", {"zone": "CET"})]),
    ("deepseek", 'Sure<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Sure", [("get_weather", PARIS)]),
    ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
     None, [("get_weather", PARIS)]),
    ("harmony", 'to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}<|call|>', None,
     [("get_time", {"zone": "CET"})]),
    ("harmony", "Hello there", "Hello there", []),
    ("gemma4", 'Checking.<|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>,days:3,tags:[<|"|>x<|"|>]}'
               "<tool_call|>", "Checking.", [("get_weather", {"city": 'Paris, "FR"', "days": 3, "tags": ["x"]})]),
    ("gemma4", "<|tool_call>call:get_time{}<tool_call|><|tool_call>call:get_time{zone:<|\"|>UTC<|\"|>}<tool_call|>",
     None, [("get_time", {}), ("get_time", {"zone": "UTC"})]),
    ("gemma4", "<|tool_call>call:get_time{zone:<|\"|>unclosed}<tool_call|>",
     "<|tool_call>call:get_time{zone:<|\"|>unclosed}<tool_call|>", []),
    ("function_gemma", "<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>",
     None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("pythonic", '<|tool_call_start|>[get_weather(city="Paris", days=3), get_time(zone=\'CET\')]<|tool_call_end|>'
                 "Done.", "Done.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]),
    ("pythonic", 'Calling.\n[get_weather(city="Paris")]\n', "Calling.", [("get_weather", PARIS)]),
    ("pythonic", "[link](http://x) text\n[get_weather(city=__import__('os').system('x'))]",
     "[link](http://x) text\n[get_weather(city=__import__('os').system('x'))]", []),
    ("json", 'Here:\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\nDone', "Here:\n\nDone",
     [("get_weather", PARIS)]),
    ("json", '{"name": "get_weather", "arguments": {"city": "Par', None, [("get_weather", None)]),  # cut short
]


def _shape(calls):
    out = []
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_") or len(c["id"]) == 9
        try:
            args = json.loads(c["function"]["arguments"])
        except json.JSONDecodeError:
            args = None  # arguments cut short stay as written
        out.append((c["function"]["name"], args))
    return out


def _stream(family, pieces):
    s = TC.CallStream(TC.get(family), TOOLS)
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    content, args, heads = "", {}, {}
    for d in deltas:  # what a client rebuilds from the streamed deltas
        if "content" in d:
            content += d["content"]
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(heads)
                heads[tc["index"]] = (tc["id"], tc["function"]["name"])
            args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
    assert content == s.content
    assert [(i, n, args[k]) for k, (i, n) in heads.items()] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in s.calls]
    return s.content.strip() or None, s.calls, deltas


@pytest.mark.parametrize("family,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parse_whole_and_every_cut(family, text, content, calls):
    got_content, got_calls = TC.parse(text, family, TOOLS)
    assert (got_content, _shape(got_calls)) == (content, calls)
    whole = (got_content, [c["function"] for c in got_calls])
    for i in range(len(text) + 1):
        c, cs, _ = _stream(family, [text[:i], text[i:]])
        assert (c, [x["function"] for x in cs]) == whole, i
    c, cs, deltas = _stream(family, list(text))
    assert (c, [x["function"] for x in cs]) == whole
    name_first = text.find('"name"') < text.find('"arguments"') or '"name"' not in text
    if family not in ("gemma4", "function_gemma", "pythonic") and calls and calls[0][1] and name_first:
        assert sum(1 for d in deltas for tc in d.get("tool_calls", []) if tc["index"] == 0) > 2


def test_three_pieces_every_pair_of_cuts():
    for family, text in (("hermes", CASES[0][1][:90]), ("mistral", CASES[18][1][:70]), ("qwen3_coder", CASES[9][1][:80])):
        whole = TC.parse(text, family, TOOLS)
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                c, cs, _ = _stream(family, [text[:i], text[i:j], text[j:]])
                assert (c, [x["function"] for x in cs]) == (whole[0], [x["function"] for x in whole[1]]), (i, j)


def test_content_before_a_call_streams_before_it_ends():
    s = TC.CallStream(TC.get("hermes"), TOOLS)
    assert s.feed("Let me check the weather") == [{"content": "Let me check the weather"}]
    assert s.feed(" now.\n<tool_") == [{"content": " now.\n"}]  # a tag's start is held back
    d = s.feed('call>\n{"name": "get_weather", "arguments": {"ci')
    assert d == [{"tool_calls": [{"index": 0, "id": s.calls[0]["id"], "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"ci'}}]}]
    assert s.feed('ty": "Paris"}}') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}]


def test_detect_families_from_template_markers():
    assert TC.detect("{{- '<tool_call>\\n{\"name\": \"' }}") == "hermes"
    assert TC.detect("<tool_call>\\n<function=example_function_name>") == "qwen3_coder"
    assert TC.detect("<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>") == "glm"
    assert TC.detect("{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}") == "llama3"
    assert TC.detect('{{- "[TOOL_CALLS][" }}') == "mistral"
    assert TC.detect("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}") == "deepseek"
    assert TC.detect('{{- "<|start|>assistant<|channel|>final<|message|>" }}') == "harmony"
    assert TC.detect("{{- '<|tool_call>call:' + function['name'] + '{' -}}") == "gemma4"
    assert TC.detect('"List of tools: <|tool_list_start|>["') == "pythonic"
    assert TC.detect("{{- '<start_function_call>call:' + function['name'] }}") == "function_gemma"
    assert TC.detect("{{ message.content }}") == "json" and TC.detect(None) == "json"
    with pytest.raises(KeyError, match="unknown tool-call family 'x'"):
        TC.get("x")


def test_mistral_ids_are_nine_alphanumerics():
    _, calls = TC.parse('[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', "mistral", TOOLS)
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()


HOSTILE = [
    ("hermes", "<tool_call>" * 100_000),
    ("hermes", "\n{" * 500_000),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": ' + "[" * 500_000),
    ("hermes", '{"name": "get_weather", "arguments": {"city": "' + "\\\\" * 500_000),
    ("json", "\n" + "{" * 1_000_000),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n" + "<parameter=city>\n" * 60_000),
    ("qwen3_coder", "<tool_call><function=" * 50_000),
    ("llama3", "<|python_tag|>" * 70_000),
    ("mistral", "[TOOL_CALLS]" + "[" * 1_000_000),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]" * 35_000),
    ("deepseek", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>" * 30_000),
    ("harmony", "<|channel|>commentary to=functions." * 30_000),
    ("gemma4", "<|tool_call>call:get_weather{" + "<|\"|>" * 200_000),
    ("pythonic", "[get_weather(" + "(" * 1_000_000),
    ("glm", "<tool_call>get_weather\n" + "<arg_key>city</arg_key><arg_value>" * 40_000),
    ("pythonic", "\n[" * 500_000),
    ("pythonic", "<|tool_call_start|>[" + "get_weather(city=1)," * 50_000 + "]<|tool_call_end|>"),
    ("hermes", "```" + "`" * 1_000_000),
    ("hermes", "\n```json\n" * 100_000),
]


@pytest.mark.parametrize("family,text", HOSTILE, ids=[f"{f}-{i}" for i, (f, _) in enumerate(HOSTILE)])
def test_hostile_text_is_bounded_and_never_raises(family, text):
    t0 = time.perf_counter()
    content, calls = TC.parse(text, family, TOOLS)
    c, cs, _ = _stream(family, [text[i:i + 4096] for i in range(0, len(text), 4096)])
    assert (c, [x["function"] for x in cs]) == (content, [x["function"] for x in calls])
    assert time.perf_counter() - t0 < 60, family  # ~1 MB: seconds (linear); quadratic work would take hours


# Each family's rendering of past calls and tool results, copied from its real template (llama.cpp's
# models/templates copies of the models' own): the loop over messages and the generation prompt.
QWEN25 = """{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""
QWEN3_CODER = """{%- for message in messages %}
    {%- if message.role == "assistant" and message.tool_calls is defined and message.tool_calls is iterable and message.tool_calls | length > 0 %}
        {{- '<|im_start|>' + message.role }}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
            {%- if tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\\n' }}
                    {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                    {{- args_value }}
                    {{- '\\n</parameter>\\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "user" or message.role == "system" or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user\\n' }}
        {%- endif %}
        {{- '<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>\\n' }}
        {%- if loop.last %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""
LLAMA32 = """{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""
MISTRAL_NEMO = """{%- for message in messages %}
    {%- if message["role"] == "user" %}
        {{- "[INST]" + message["content"] + "[/INST]" }}
    {%- elif (message.tool_calls is defined and message.tool_calls is not none) %}
        {{- "[TOOL_CALLS][" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS]{"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}"""
MISTRAL_SMALL32 = """{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {%- if message.get('tool_calls') %}
            {%- for tool_call in message.tool_calls %}
                {{- '[TOOL_CALLS]' + tool_call.function.name }}
                {%- if not tool_call.id is defined or tool_call.id is not string or tool_call.id|length != 9 %}
                    {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
                {%- endif %}
                {{- '[CALL_ID]' + tool_call.id }}
                {{- '[ARGS]' + tool_call['function']['arguments']|tojson }}
            {%- endfor %}
            {{- eos_token }}
        {%- elif message['content'] is string %}
            {{- message['content'] + eos_token }}
        {%- endif %}
    {%- elif message['role'] == 'tool_results' or message['role'] == 'tool' %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {%- if not message.tool_call_id is defined or message.tool_call_id is not string or message['tool_call_id']|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '[TOOL_RESULTS]' + message.tool_call_id + '[TOOL_CONTENT]' + content|string + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}"""
DEEPSEEK_V31 = """{%- set ns = namespace(is_first=false, is_tool=false, is_last_user=false) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'user' -%}
    {%- set ns.is_tool = false -%}
    {%- set ns.is_first = false -%}
    {%- set ns.is_last_user = true -%}
    {{'<｜User｜>' + message['content']}}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message['tool_calls'] -%}
    {%- if ns.is_last_user -%}{{'<｜Assistant｜><think></think>'}}
    {%- endif -%}
    {%- set ns.is_last_user = false -%}
    {%- set ns.is_first = false -%}
    {%- set ns.is_tool = false -%}
    {%- for tool in message['tool_calls'] -%}
      {%- if not ns.is_first -%}
        {%- if not message['content'] -%}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] | tojson + '<｜tool▁call▁end｜>'}}
          {%- else -%}{{message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] | tojson + '<｜tool▁call▁end｜>'}}
        {%- endif -%}
        {%- set ns.is_first = true -%}
        {%- else -%}{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] | tojson + '<｜tool▁call▁end｜>'}}
      {%- endif -%}
    {%- endfor -%}
    {{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
  {%- endif -%}
  {%- if message['role'] == 'tool' -%}
    {%- set ns.is_last_user = false -%}
    {%- set ns.is_tool = true -%}{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.is_last_user and not ns.is_tool -%}{{'<｜Assistant｜>'}}{{'<think></think>'}}
{%- endif %}"""
GPT_OSS = """{%- set last_tool_call = namespace(name=none) %}
{%- for message in messages -%}
    {%- if message.role == 'assistant' -%}
        {%- if "tool_calls" in message %}
            {%- set tool_call = message.tool_calls[0] %}
            {%- if tool_call.function %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- "<|start|>assistant to=" }}
            {{- "functions." + tool_call.name + "<|channel|>commentary " }}
            {{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}
            {{- tool_call.arguments|tojson }}
            {{- "<|call|>" }}
            {%- set last_tool_call.name = tool_call.name %}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
            {%- set last_tool_call.name = none %}
        {%- endif %}
    {%- elif message.role == 'tool' -%}
        {%- if last_tool_call.name is none %}
            {{- raise_exception("Message has tool role, but there was no previous assistant message with a tool call!") }}
        {%- endif %}
        {{- "<|start|>functions." + last_tool_call.name }}
        {{- " to=assistant<|channel|>commentary<|message|>" + message.content|tojson + "<|end|>" }}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}"""
GEMMA4 = """{%- macro format_argument(argument, escape_keys=True) -%}
    {%- if argument is string -%}
        {{- '<|"|>' + argument + '<|"|>' -}}
    {%- elif argument is boolean -%}
        {{- 'true' if argument else 'false' -}}
    {%- elif argument is mapping -%}
        {{- '{' -}}
        {%- set ns = namespace(found_first=false) -%}
        {%- for key, value in argument | dictsort -%}
            {%- if ns.found_first %},{% endif -%}
            {%- set ns.found_first = true -%}
            {%- if escape_keys -%}
                {{- '<|"|>' + key + '<|"|>' -}}
            {%- else -%}
                {{- key -}}
            {%- endif -%}
            :{{- format_argument(value, escape_keys=escape_keys) -}}
        {%- endfor -%}
        {{- '}' -}}
    {%- elif argument is sequence -%}
        {{- '[' -}}
        {%- for item in argument -%}
            {{- format_argument(item, escape_keys=escape_keys) -}}
            {%- if not loop.last %},{% endif -%}
        {%- endfor -%}
        {{- ']' -}}
    {%- else -%}
        {{- argument -}}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(prev_message_type=None) -%}
{%- for message in messages -%}
    {%- set ns.prev_message_type = None -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
        {{- '<|turn>' + role + '\\n' }}
            {%- if message['tool_calls'] -%}
                {%- for tool_call in message['tool_calls'] -%}
                    {%- set function = tool_call['function'] -%}
                    {{- '<|tool_call>call:' + function['name'] + '{' -}}
                    {%- if function['arguments'] is mapping -%}
                        {%- set ns_args = namespace(found_first=false) -%}
                        {%- for key, value in function['arguments'] | dictsort -%}
                            {%- if ns_args.found_first %},{% endif -%}
                            {%- set ns_args.found_first = true -%}
                            {{- key -}}:{{- format_argument(value, escape_keys=False) -}}
                        {%- endfor -%}
                    {%- elif function['arguments'] is string -%}
                        {{- function['arguments'] -}}
                    {%- endif -%}
                    {{- '}<tool_call|>' -}}
                {%- endfor -%}
                {%- set ns.prev_message_type = 'tool_call' -%}
            {%- endif -%}
            {%- if message['tool_responses'] -%}
                {%- for tool_response in message['tool_responses'] -%}
                    {{- '<|tool_response>' -}}
                    {%- if tool_response['response'] is mapping -%}
                        {{- 'response:' + tool_response['name'] | default('unknown') + '{' -}}
                        {%- for key, value in tool_response['response'] | dictsort -%}
                            {{- key -}}:{{- format_argument(value, escape_keys=False) -}}
                            {%- if not loop.last %},{% endif -%}
                        {%- endfor -%}
                        {{- '}' -}}
                    {%- else -%}
                        {{- 'response:' + tool_response['name'] | default('unknown') + '{value:' + format_argument(tool_response['response'], escape_keys=False) + '}' -}}
                    {%- endif -%}
                    {{- '<tool_response|>' -}}
                {%- endfor -%}
                {%- set ns.prev_message_type = 'tool_response' -%}
            {%- endif -%}
            {%- if message['content'] is string -%}
                {{- message['content'] | trim -}}
            {%- endif -%}
        {%- if not (message['tool_responses'] and not message['content']) -%}
            {{- '<turn|>\\n' -}}
        {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {%- if ns.prev_message_type != 'tool_response' -%}
        {{- '<|turn>model\\n' -}}
    {%- endif -%}
{%- endif -%}"""

ROUND_TRIP = [  # (family, template, what the tool result must render as)
    ("hermes", QWEN25, "<tool_response>\n18 C, sunny\n</tool_response>"),
    ("qwen3_coder", QWEN3_CODER, "<tool_response>\n18 C, sunny\n</tool_response>"),
    ("llama3", LLAMA32, '<|start_header_id|>ipython<|end_header_id|>\n\n"18 C, sunny"<|eot_id|>'),
    ("mistral", MISTRAL_NEMO, '[TOOL_RESULTS]{"content": 18 C, sunny, "call_id": "'),
    ("mistral", MISTRAL_SMALL32, "[TOOL_CONTENT]18 C, sunny[/TOOL_RESULTS]"),
    pytest.param("deepseek", DEEPSEEK_V31, "<｜tool▁output▁begin｜>18 C, sunny<｜tool▁output▁end｜>"),
    pytest.param("harmony", GPT_OSS, '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
                 '"18 C, sunny"<|end|>'),
    ("gemma4", GEMMA4, "<|tool_response>response:get_weather{value:<|\"|>18 C, sunny<|\"|>}<tool_response|>"),
]


@pytest.mark.parametrize("family,template,result", ROUND_TRIP,
                         ids=["hermes", "qwen3_coder", "llama3", "mistral_nemo", "mistral_small", "deepseek", "harmony",
                              "gemma4"])
def test_calls_round_trip_through_the_family_template(family, template, result):
    """Our message shapes render through the family's template (ondevice's own sandboxed renderer); the
    call as the template writes it (what the model learned to write) parses back to the same call, whole
    and streamed; the tool's result renders the family's way."""
    from ondevice.chat import render

    user = {"role": "user", "content": "Weather in Paris for 3 days?"}
    args = {"city": "Paris", "days": 3, "tags": ["a<b", "ü"]}
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0123456789abcdef01234567",
            "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]}
    tool = {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "18 C, sunny"}
    prompt = render(template, TC.template_messages([user], family), eos_token="</s>")
    history = render(template, TC.template_messages([user, call], family), add_generation_prompt=False,
                     eos_token="</s>")
    assert history.startswith(prompt), (prompt, history)
    written = history[len(prompt):]  # the model's turn, as the template writes it
    content, calls = TC.parse(written, family, TOOLS)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("get_weather", args)]
    c, cs, _ = _stream(family, list(written))
    assert [x["function"] for x in cs] == [x["function"] for x in calls]
    full = render(template, TC.template_messages([user, call, tool], family), eos_token="</s>")
    assert result in full


REAL = {  # llama.cpp's models/templates file → family
    "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes", "Qwen-Qwen3-0.6B.jinja": "hermes", "Qwen-QwQ-32B.jinja": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "hermes", "ibm-granite-granite-4.0.jinja": "hermes",
    "Qwen3-Coder.jinja": "qwen3_coder", "Qwen3.5-4B.jinja": "qwen3_coder",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": "qwen3_coder",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3", "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama3",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral", "Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral",
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": "mistral", "unsloth-mistral-Devstral-Small-2507.jinja": "mistral",
    "openai-gpt-oss-120b.jinja": "harmony", "google-gemma-4-31B-it.jinja": "gemma4",
    "google-gemma-4-31B-it-interleaved.jinja": "gemma4", "LFM2-8B-A1B.jinja": "pythonic",
}


@pytest.mark.skipif(not __import__("os").environ.get("ONDEVICE_TEMPLATES_DIR"),
                    reason="set ONDEVICE_TEMPLATES_DIR to a copy of llama.cpp's models/templates")
def test_real_templates_round_trip():
    """With the models' full templates: each is detected as its family, and a past call renders through it
    (ondevice's renderer, our message shapes) and parses back."""
    import os
    from pathlib import Path

    from ondevice.chat import render

    user = {"role": "user", "content": "Weather in Paris?"}
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0123456789abcdef01234567",
            "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    checked = 0
    for name, family in REAL.items():
        f = Path(os.environ["ONDEVICE_TEMPLATES_DIR"]) / name
        if not f.exists():
            continue
        src = f.read_text()
        assert TC.detect(src) == family, name
        if family == "pythonic":
            continue  # LFM2's template does not write calls back
        history = render(src, TC.template_messages([user, call], family), tools=TOOLS, add_generation_prompt=False)
        _, calls = TC.parse(history, family, TOOLS)
        assert [c["function"]["name"] for c in calls][-1:] == ["get_weather"], name
        checked += 1
    assert checked


@pytest.mark.parametrize("convention,family,text,reasoning", ids=["harmony", "hermes", "qwen3_coder"], argvalues=[
    (("harmony", "<|channel|>analysis<|message|>", "<|end|>"), "harmony",
     "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>', "Need the weather."),
    (("tags", "<think>", "</think>"), "hermes",
     '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}\n</tool_call>', "\nThe user wants weather.\n"),
    (("tags", "<think>", "</think>"), "qwen3_coder",
     "<think>\nhm <tool_call> is a tag\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n</function>\n</tool_call>", "\nhm <tool_call> is a tag\n"),
])
def test_thinking_then_calls_pipeline(convention, family, text, reasoning):
    """The server's order: the reasoning splitter first, its content deltas into the call stream; a tag
    inside thinking is not a call, and every cut gives the whole result."""
    from ondevice import reasoning as R

    thinking = R.Thinking(*convention)
    for cuts in [[len(text)], *[[i] for i in range(0, len(text), 3)]]:
        split, calls = R.Splitter(thinking), TC.CallStream(TC.get(family), TOOLS)
        r = []
        for piece in [text[:cuts[0]], text[cuts[0]:], None]:
            rd, cd = split.feed(piece) if piece is not None else split.finish()
            r.append(rd)
            calls.feed(cd)
        calls.finish()
        assert "".join(r) == reasoning and calls.content.strip() == ""
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls.calls] == [
            ("get_weather", PARIS)]


def test_fuzz_mutated_outputs_never_raise_and_any_cut_gives_the_whole():
    """Seeded random edits of every case (markers, brackets, quotes inserted, characters dropped), parsed
    by its own family and a random other one, cut at three random places."""
    import random

    rng = random.Random(38)
    alphabet = [*'{}[]":,<>|\\\n `', "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|channel|>",
                "<|message|>", "<|call|>", "```", "<function=", "</parameter>", '<|"|>', "<tool_call|>", "call:",
                "get_weather", '"name"', '"arguments"', "<arg_key>", "</arg_value>", "<｜tool▁sep｜>"]
    for _ in range(600):
        family, text = rng.choice(CASES)[:2]
        t = list(text)
        for _ in range(rng.randint(1, 4)):
            k = rng.randrange(len(t) + 1)
            if rng.random() < 0.4 and t:
                del t[min(k, len(t) - 1)]
            else:
                t.insert(k, rng.choice(alphabet))
        text = "".join(t)
        for fam in (family, rng.choice(list(TC.FAMILIES))):
            whole = TC.parse(text, fam, TOOLS)
            cuts = sorted(rng.sample(range(len(text) + 1), 3))
            c, cs, _ = _stream(fam, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
            assert (c, [x["function"] for x in cs]) == (whole[0], [x["function"] for x in whole[1]]), (fam, text, cuts)
