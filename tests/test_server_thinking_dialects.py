"""Thinking in the Anthropic Messages and OpenAI Responses dialects, through the real ``anthropic`` and
``openai`` clients, whole and streamed: a tiny model with Qwen3's chat template and a grammar forcing
``<think>…</think>`` then an answer (or a call); each answer is checked against the same prompt decoded
directly (greedy, no speculation) and read back by a regex (``tests/test_reasoning_server.py``'s setup)."""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from tests.test_reasoning_server import KEY, MSGS, QWEN3, WEATHER, WORDS, Served, templated  # noqa: E402

THINK = f'start: "<think>\\n" {WORDS} "\\n</think>\\n\\n" {WORDS}'
THINK_CALL = (f'start: "<think>\\n" {WORDS} "\\n</think>\\n\\n<tool_call>\\n{{\\"name\\": \\"get_weather\\", '
              f'\\"arguments\\": {{\\"city\\": \\"" /[A-Z][a-z]{{1,7}}/ "\\"}}}}\\n</tool_call>"')
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Weather",
                     "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def qwen3(tiny_hf, tmp_path_factory):
    s = Served(templated(tiny_hf, tmp_path_factory, "qwen3-dialects", QWEN3))
    s.url = str(s.client.base_url).rstrip("/").removesuffix("/v1")
    s.anthropic = anthropic.Anthropic(base_url=s.url, api_key=KEY, max_retries=0, timeout=120)
    yield s
    s.close()


def _want(qwen3, grammar: str, tools=None) -> tuple[str, str]:
    """(thinking, the rest) of the answer decoded directly."""
    text = qwen3.plain(grammar, tools=tools)
    m = re.fullmatch(r"<think>(.*?)</think>\n\n(.*)", text, re.DOTALL)
    assert m, text
    return m[1], m[2]


def _blocks(msg) -> list[tuple]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text if b.type == "text" else (b.name, b.input))
            for b in msg.content]


def test_anthropic_thinking_blocks_whole_and_streamed(qwen3):
    thinking, answer = _want(qwen3, THINK)
    args = dict(model=qwen3.model, max_tokens=200, messages=MSGS,  # the newest client takes no temperature
                extra_body={"grammar": THINK, "gamma": 3, "temperature": 0})
    whole = qwen3.anthropic.messages.create(**args)
    assert _blocks(whole) == [("thinking", thinking), ("text", answer)] and whole.stop_reason == "end_turn"
    with qwen3.anthropic.messages.stream(**args) as s:
        events = list(s)
        final = s.get_final_message()
    assert _blocks(final) == _blocks(whole)
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas and "text_delta" in deltas
    assert deltas.index("text_delta") > max(i for i, d in enumerate(deltas) if d == "thinking_delta")
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    # thinking as a call's preamble: thinking block, then tool_use
    as_rendered = {"type": "function", "function": {"name": "get_weather",  # the dialect's key order
                                                    "parameters": ANTHROPIC_WEATHER["input_schema"],
                                                    "description": "Weather"}}
    thinking, call = _want(qwen3, THINK_CALL, tools=[as_rendered])
    city = re.search(r'"city": "(\w+)"', call)[1]
    args = {**args, "tools": [ANTHROPIC_WEATHER], "extra_body": {"grammar": THINK_CALL, "gamma": 3, "temperature": 0}}
    whole = qwen3.anthropic.messages.create(**args)
    want = [("thinking", thinking), ("tool_use", ("get_weather", {"city": city}))]
    assert _blocks(whole) == want and whole.stop_reason == "tool_use"
    with qwen3.anthropic.messages.stream(**args) as s:
        assert _blocks(s.get_final_message()) == want


def test_anthropic_thinking_param_reaches_the_template(qwen3):
    def n(thinking):
        r = qwen3.anthropic.messages.create(model=qwen3.model, max_tokens=1, messages=MSGS,
                                            **({"thinking": thinking} if thinking else {}))
        return r.usage.input_tokens

    assert n({"type": "disabled"}) > n(None) == n({"type": "enabled", "budget_tokens": 1024})  # the closed block


def _items(resp) -> list[tuple]:
    out = []
    for it in resp.output:
        if it.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in it.content or [])))
        elif it.type == "message":
            out.append(("message", "".join(c.text for c in it.content)))
        else:
            out.append((it.type, (it.name, json.loads(it.arguments))))
    return out


def test_responses_reasoning_items_whole_and_streamed(qwen3):
    thinking, answer = _want(qwen3, THINK)
    args = dict(model=qwen3.model, input=MSGS[0]["content"], max_output_tokens=200, temperature=0,
                extra_body={"grammar": THINK, "gamma": 3})
    whole = qwen3.client.responses.create(**args)
    assert _items(whole) == [("reasoning", thinking), ("message", answer)] and whole.status == "completed"
    assert whole.output_text == answer
    events = list(qwen3.client.responses.create(stream=True, **args))
    final = events[-1].response
    assert _items(final) == _items(whole)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thinking
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    thinking, call = _want(qwen3, THINK_CALL, tools=[WEATHER])
    city = re.search(r'"city": "(\w+)"', call)[1]
    tool = {"type": "function", **WEATHER["function"]}
    args = {**args, "tools": [tool], "extra_body": {"grammar": THINK_CALL, "gamma": 3}}
    want = [("reasoning", thinking), ("function_call", ("get_weather", {"city": city}))]
    assert _items(qwen3.client.responses.create(**args)) == want
    assert _items(list(qwen3.client.responses.create(stream=True, **args))[-1].response) == want
