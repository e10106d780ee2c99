"""The Anthropic Messages API (``/v1/messages``): the real ``anthropic`` client against ``ondevice serve`` on a
free loopback port (SmolLM2), every greedy answer compared with the same conversation run directly."""

from __future__ import annotations

import json

import pytest
from helpers import loaded, served

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

KEY = "test-key-anthropic"
N_CTX = 512
SYSTEM = "You are terse."
USER = "Repeat exactly: the cat sat on the mat, the cat sat on the mat."
GREEDY = {"temperature": 0}  # the newest anthropic clients send sampling fields only through extra_body
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server(smollm2):
    yield from served(smollm2, N_CTX, KEY)


@pytest.fixture(scope="module")
def direct(smollm2):
    yield from loaded(smollm2, N_CTX)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(server):
    return httpx.get(server + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]


def test_whole_greedy_equals_runtime(client, model_id, direct):
    want = direct.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
                       temperature=0, max_tokens=24)
    m = client.messages.create(model=model_id, system=SYSTEM, max_tokens=24, extra_body=GREEDY,
                               messages=[{"role": "user", "content": USER}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.text
    assert m.usage.input_tokens == want.stats.prompt_tokens and m.usage.output_tokens == want.stats.tokens
    assert m.stop_reason == {"eos": "end_turn", "length": "max_tokens"}[want.stats.stop_reason]


def test_streamed_in_anthropics_order(client, model_id, direct, server):
    """The client's own stream helper reassembles the answer; the raw events come in Anthropic's order."""
    msgs = [{"role": "user", "content": USER}]
    want = direct.chat([{"role": "system", "content": SYSTEM}, *msgs], temperature=0, max_tokens=24)
    with client.messages.stream(model=model_id, system=[{"type": "text", "text": SYSTEM}], max_tokens=24,
                                extra_body=GREEDY, messages=msgs) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == want.text
    assert final.usage.output_tokens == want.stats.tokens and final.usage.input_tokens == want.stats.prompt_tokens
    body = {"model": model_id, "system": SYSTEM, "max_tokens": 24, "temperature": 0, "messages": msgs, "stream": True}
    r = httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120)
    events = [(e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1].removeprefix("data: ")))
              for e in r.text.strip().split("\n\n")]
    names = [n for n, _ in events]
    assert all(n == d["type"] for n, d in events)
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas >= 1
    assert events[-2][1]["delta"]["stop_reason"] == final.stop_reason
    assert events[-2][1]["usage"]["output_tokens"] == want.stats.tokens


def test_multi_turn_stop_sequence_and_prefill(client, model_id, direct):
    conv = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": [{"type": "text", "text": "List three fruits, one per line."}]}]
    want = direct.chat(conv, temperature=0, max_tokens=40, stop=["\n"])
    m = client.messages.create(model=model_id, max_tokens=40, extra_body=GREEDY, messages=conv, stop_sequences=["\n"])
    assert m.content[0].text == want.text
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "\n")
    # a last assistant turn is a prefill: the answer continues it
    ids = direct.render_chat(conv) + direct.tokenize("1.", add_bos=False)
    pre = direct.generate(ids, temperature=0, max_tokens=12)
    m = client.messages.create(model=model_id, max_tokens=12, extra_body=GREEDY,
                               messages=[*conv, {"role": "assistant", "content": "1."}])
    assert m.content[0].text == pre.text


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_then_tool_result(client, model_id, stream):
    """tool_choice 'tool' constrains the answer to one call with input following the schema; the result goes
    back as a tool_result block and the next turn is answered."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=model_id, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"}, messages=ask)
    if stream:
        with client.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str) and use.id.startswith("toolu_")
    follow = [*ask, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]}]
    m2 = client.messages.create(model=model_id, max_tokens=16, extra_body=GREEDY, tools=[WEATHER], messages=follow)
    assert m2.content and m2.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_count_tokens_matches_usage(client, model_id):
    kw = dict(model=model_id, system=SYSTEM, messages=[{"role": "user", "content": USER}])
    n = client.messages.count_tokens(**kw).input_tokens
    assert n == client.messages.create(max_tokens=1, **kw).usage.input_tokens > 5


def test_errors_in_anthropics_shape(client, model_id, server):
    ok = {"model": model_id, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    cases = [
        ({k: v for k, v in ok.items() if k != "max_tokens"}, {"x-api-key": KEY}, 400, "invalid_request_error"),
        ({**ok, "model": "claude-opus-4"}, {"x-api-key": KEY}, 404, "not_found_error"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, {"x-api-key": KEY},
         400, "invalid_request_error"),
        ({**ok, "messages": [{"role": "user", "content": "word " * 600}]}, {"x-api-key": KEY}, 400,
         "invalid_request_error"),
        ({**ok, "temperature": 1.5}, {"x-api-key": KEY}, 400, "invalid_request_error"),
        (ok, {"x-api-key": "wrong"}, 401, "authentication_error"),
        (ok, {}, 401, "authentication_error"),
    ]
    for body, headers, status, kind in cases:
        r = httpx.post(server + "/v1/messages", json=body, headers=headers, timeout=60)
        doc = r.json()
        assert (r.status_code, doc["type"], doc["error"]["type"]) == (status, "error", kind), r.text[:200]
        assert doc["error"]["message"] and "\n" not in doc["error"]["message"]
    r = httpx.post(server + "/v1/messages/count_tokens", json={**ok, "model": "nope"}, headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="messages: must be a non-empty"):
        client.messages.create(model=model_id, max_tokens=4, messages=[])  # empty messages
    # Bearer auth works as well, and the server still answers
    r = httpx.post(server + "/v1/messages", json=ok, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_output_config_json_schema(client, model_id):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green"]}},
              "required": ["colour"], "additionalProperties": False}
    m = client.messages.create(model=model_id, max_tokens=40, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}},
                               messages=[{"role": "user", "content": "Pick a colour."}])
    assert json.loads(m.content[0].text)["colour"] in ("red", "green")
