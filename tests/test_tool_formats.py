"""Tool calls in every family's own format: exact parses, any cut of the text into pieces gives the whole
parse (arguments streamed incrementally), text that is not a call stays content, hostile text is linear."""

from __future__ import annotations

import json
import time

import pytest

from ondevice import toolcalls as TC

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"type": "string"}}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
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


@pytest.mark.parametrize("family,text,content,calls", CASES)
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
    if family not in ("gemma4", "pythonic") and calls and calls[0][1] and name_first:  # arguments in pieces
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
    assert TC.detect("{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}") == "llama3"
    assert TC.detect('{{- "[TOOL_CALLS][" }}') == "mistral"
    assert TC.detect("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}") == "deepseek"
    assert TC.detect('{{- "<|start|>assistant<|channel|>final<|message|>" }}') == "harmony"
    assert TC.detect("{{- '<|tool_call>call:' + function['name'] + '{' -}}") == "gemma4"
    assert TC.detect('"List of tools: <|tool_list_start|>["') == "pythonic"
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
