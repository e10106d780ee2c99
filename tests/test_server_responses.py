"""The OpenAI Responses API (``/v1/responses``): the real ``openai`` client against ``ondevice serve`` on a free
loopback port (SmolLM2), every greedy answer compared with the same conversation run directly."""

from __future__ import annotations

import json

import pytest
from helpers import loaded, served

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "test-key-responses"
N_CTX = 512
INSTRUCTIONS = "You are terse."
USER = "Repeat exactly: the cat sat on the mat, the cat sat on the mat."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server(smollm2):
    yield from served(smollm2, N_CTX, KEY)


@pytest.fixture(scope="module")
def direct(smollm2):
    yield from loaded(smollm2, N_CTX)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def test_whole_greedy_equals_runtime(client, model_id, direct):
    want = direct.chat([{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": USER}],
                       temperature=0, max_tokens=24)
    r = client.responses.create(model=model_id, instructions=INSTRUCTIONS, input=USER, temperature=0,
                                max_output_tokens=24, store=False)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == want.text
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == want.stats.prompt_tokens and r.usage.output_tokens == want.stats.tokens
    assert r.status == {"eos": "completed", "length": "incomplete"}[want.stats.stop_reason]


def test_streamed_events_and_helper(client, model_id, direct):
    items = [{"role": "user", "content": [{"type": "input_text", "text": USER}]}]
    want = direct.chat([{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": USER}],
                       temperature=0, max_tokens=24)
    events = list(client.responses.create(model=model_id, instructions=INSTRUCTIONS, input=items, temperature=0,
                                          max_output_tokens=24, stream=True))
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    last = "response.completed" if want.stats.stop_reason == "eos" else "response.incomplete"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * n, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", last] and n >= 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.text
    assert events[-1].response.output_text == want.text
    assert events[-1].response.usage.output_tokens == want.stats.tokens
    with client.responses.stream(model=model_id, instructions=INSTRUCTIONS, input=items, temperature=0,
                                 max_output_tokens=24) as s:
        final = s.get_final_response()
    assert final.output_text == want.text


def test_previous_response_id_continues_the_conversation(client, model_id, direct):
    first = client.responses.create(model=model_id, input="Name a colour.", temperature=0, max_output_tokens=8)
    second = client.responses.create(model=model_id, input="Name another.", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=8)
    want = direct.chat([{"role": "user", "content": "Name a colour."},
                        {"role": "assistant", "content": first.output_text},
                        {"role": "user", "content": "Name another."}], temperature=0, max_tokens=8)
    assert second.output_text == want.text and second.usage.input_tokens == want.stats.prompt_tokens
    unstored = client.responses.create(model=model_id, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model=model_id, input="Again", previous_response_id=unstored.id, max_output_tokens=2)


def test_store_is_bounded():
    from ondevice.server.responses import Store

    s = Store(size=3)
    for i in range(5):
        s.put(f"r{i}", [{"role": "user", "content": str(i)}])
    s.get("r2")  # used: kept over r3
    s.put("r5", [])
    assert sorted(s._items) == ["r2", "r4", "r5"]


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_then_output(client, model_id, stream):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=model_id, input=ask, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
              temperature=0, max_output_tokens=60)
    if stream:
        with client.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**kw)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    follow = [*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    r2 = client.responses.create(model=model_id, input=follow, tools=[WEATHER], temperature=0, max_output_tokens=16)
    assert r2.output and r2.usage.input_tokens > r.usage.input_tokens


def test_text_format_json_schema(client, model_id):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green"]}},
              "required": ["colour"], "additionalProperties": False}
    r = client.responses.create(model=model_id, input="Pick a colour.", temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    assert json.loads(r.output_text)["colour"] in ("red", "green")


def test_errors_in_openais_shape(server, model_id, client):
    ok = {"model": model_id, "input": "Hi", "max_output_tokens": 4}
    cases = [
        ({**ok, "model": "gpt-5"}, 404, "model_not_found"),
        ({**ok, "input": [{"type": "input_image", "image_url": "x"}]}, 400, "unsupported_value"),
        ({**ok, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
         "unsupported_value"),
        ({**ok, "input": "word " * 600}, 400, "context_length_exceeded"),
        ({**ok, "tools": [{"type": "web_search"}]}, 400, "unsupported_value"),
        ({**ok, "background": True}, 400, "unsupported_parameter"),
        ({**ok, "temperature": 3}, 400, "invalid_value"),
        ({**ok, "input": []}, 400, "invalid_value"),
    ]
    for body, status, code in cases:
        r = httpx.post(server + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        err = r.json()["error"]
        assert (r.status_code, err["code"]) == (status, code), r.text[:200]
        assert err["message"] and "\n" not in err["message"]
    assert client.responses.create(model=model_id, input="Hi", max_output_tokens=4).output_text is not None
