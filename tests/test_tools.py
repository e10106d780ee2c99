"""Tool calls: checked, rendered through a real Qwen2.5 template, constrained (required / named) and parsed."""

from __future__ import annotations

import json

import jsonschema
import pytest

import ondevice
from ondevice import toolcalls
from ondevice import tools as T
from ondevice.errors import OndeviceError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}}}}
TOOLS = [WEATHER, TIME]


def _params(name):
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_parse_hermes_calls_and_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>')
    content, calls = T.parse_calls(text, "hermes", TOOLS)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    # unknown function or broken JSON: left as content, never dropped
    bad = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    assert T.parse_calls(bad, "hermes", TOOLS) == (bad, [])
    assert T.parse_calls("plain answer", "hermes", TOOLS) == ("plain answer", [])
    assert T.parse_calls('{"name": "get_time", "arguments": {"zone": 3}}', "json", TOOLS)[1][0]["function"]["name"] == "get_time"
    # Qwen2.5's <tool_call> tags are special tokens, which render as nothing: bare call objects end the answer
    content, calls = T.parse_calls('Sure.\n{"name": "get_time", "arguments": {"zone": 1}}\n\n'
                                   '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n', "hermes", TOOLS)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert T.parse_calls('a {"x": 1}', "hermes", TOOLS) == ('a {"x": 1}', [])


def test_choice_and_checks():
    assert T.choice_of(None, TOOLS) == "auto"
    assert T.choice_of({"type": "function", "function": {"name": "get_time"}}, TOOLS) == "get_time"
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"type": "x"}):
        with pytest.raises(OndeviceError):
            T.choice_of(bad, TOOLS)
    for bad in ([], [{"type": "function"}], [WEATHER, WEATHER], [{"type": "function", "function": {"name": "a b"}}]):
        with pytest.raises(OndeviceError):
            T.check_tools(bad)
    with pytest.raises(OndeviceError, match=r"^tools\[1\]\.function\.parameters: json schema: .*nosuch"):
        T.check_tools([WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "nosuch"}}}])


def test_qwen_template_renders_tools_and_calls():
    """The Qwen2.5 family's own template (read from the catalog model's GGUF header) gets tools and past calls."""
    from ondevice.chat import render
    from ondevice.formats.gguf import read_header
    from ondevice.store import catalog
    from ondevice.store.fetch import is_pulled

    entry = catalog.get("qwen2.5-coder-0.5b-instruct")
    if not is_pulled(entry):
        pytest.skip("qwen2.5-coder-0.5b-instruct is not pulled (ondevice pull qwen2.5-coder-0.5b-instruct)")
    tmpl = read_header(catalog.cached_path(entry))[0]["tokenizer.chat_template"]
    assert T.call_format(tmpl) == "hermes"
    msgs = toolcalls.template_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}], toolcalls.detect(tmpl))
    text = render(tmpl, msgs, tools=TOOLS)
    assert '"name": "get_weather"' in text and "<tools>" in text and "<tool_response>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in text


@pytest.mark.parametrize("fmt", ["hermes", "json"])
def test_required_and_named_calls_validate(tiny_gguf, fmt):
    with ondevice.load(tiny_gguf("qwen2"), drafter="ngram", threads=1) as rt:
        for choice, seed in (("required", 1), ("required", 2), ("get_time", 3), ("get_weather", 4)):
            res = rt.generate("Call a tool:", grammar=T.call_grammar(TOOLS, choice, fmt), temperature=1.0, seed=seed,
                              max_tokens=120)
            assert res.stats.stop_reason == "eos", res.text
            content, calls = T.parse_calls(res.text, fmt, TOOLS)
            assert content is None and len(calls) == 1
            name = calls[0]["function"]["name"]
            assert choice in ("required", name)
            jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), _params(name))


@pytest.mark.slow
def test_auto_parses_qwen_calls():
    """tool_choice 'auto' on the real Qwen2.5-Coder-0.5B: its own call (tags are special tokens) is parsed."""
    from ondevice.store import catalog
    from ondevice.store.fetch import is_pulled

    if not is_pulled(catalog.get("qwen2.5-coder-0.5b-instruct")):
        pytest.skip("qwen2.5-coder-0.5b-instruct is not pulled")
    with ondevice.load("qwen2.5-coder-0.5b-instruct", drafter="ngram", threads=1, n_ctx=1024) as rt:
        fmt = T.call_format(rt.target.chat_template)
        ids = rt.render_chat([{"role": "user", "content": "What is the weather in Paris, in Celsius?"}], tools=TOOLS)
        res = rt.generate(ids, temperature=0, max_tokens=60, gamma=4)
    content, calls = T.parse_calls(res.text, fmt, TOOLS)
    assert fmt == "hermes" and len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), _params("get_weather"))
