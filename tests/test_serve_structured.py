"""``ondevice serve`` with structured output, tools and logprobs, through the real ``openai`` client.

Tiny models (a target and its draft): every answer is compared with the same request made directly on a
``Runtime`` with plain decoding (γ = 0), so speculation in the server (n-gram, or the draft) is checked token
for token against plain constrained decoding.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.test_constrain import SCHEMAS
from tests.test_tools import TOOLS, _params

openai = pytest.importorskip("openai")

KEY = "k-structured"
MSGS = [{"role": "user", "content": "The model draft and the target verify"}]


@pytest.fixture(scope="module", params=["ngram", "pair"])
def served(request, tiny_gguf):
    """(client, model id, direct runtime, γ) for a server with n-gram drafting or a target + draft pair."""
    from ondevice.loader import load
    from ondevice.server.run import launch

    target = str(tiny_gguf("qwen2"))
    args = ["--n-ctx", "512", "--threads", "1"]
    if request.param == "pair":
        args += ["--draft", str(tiny_gguf("qwen2_draft"))]
    proc, url = launch(target, *args, api_key=KEY)
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    try:
        with load(target, drafter="none", n_ctx=512, threads=1) as direct:
            yield client, client.models.list().data[0].id, direct, 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _rf(name):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_answers_validate_and_equal_plain(served, name):
    client, model, direct, gamma = served
    want = direct.chat(MSGS, temperature=0, max_tokens=120, gamma=0, response_format=_rf(name))
    r = client.chat.completions.create(model=model, messages=MSGS, temperature=0, max_tokens=120,
                                       response_format=_rf(name), extra_body={"gamma": gamma})
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert text == want.text and r.usage.completion_tokens == want.stats.tokens
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=model, messages=MSGS, temperature=0, max_tokens=120, stream=True,
                                                 response_format=_rf(name), extra_body={"gamma": gamma}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text


def test_json_object_and_sampled(served):
    client, model, direct, gamma = served
    for seed in (1, 2):
        r = client.chat.completions.create(model=model, messages=MSGS, temperature=1.0, seed=seed, max_tokens=200,
                                           response_format=_rf("nested"), extra_body={"gamma": gamma})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["nested"])
    r = client.chat.completions.create(model=model, messages=MSGS, temperature=0, max_tokens=300,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_equal_the_runtime(served, stream):
    client, model, direct, gamma = served
    want = direct.chat(MSGS, temperature=0, max_tokens=30, gamma=0, response_format=_rf("required_fields"),
                       logprobs=True, top_logprobs=4)
    kw = dict(model=model, messages=MSGS, temperature=0, max_tokens=30, response_format=_rf("required_fields"),
              logprobs=True, top_logprobs=4, extra_body={"gamma": gamma})
    if stream:
        content = [x for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs
                   for x in c.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert [x.logprob for x in content] == [lp.logprob for lp in want.logprobs]
    assert [[t.logprob for t in x.top_logprobs] for x in content] == [[v for _, v in lp.top] for lp in want.logprobs]
    assert b"".join(bytes(x.bytes) for x in content).decode() == want.text  # a token may hold part of a character
    tb = direct.target.token_bytes
    assert [bytes(x.bytes) for x in content] == [tb(lp.token) for lp in want.logprobs]


def test_completions_logprobs(served):
    client, model, direct, gamma = served
    want = direct.generate("The model", temperature=0, max_tokens=12, gamma=0, logprobs=True, top_logprobs=2)
    r = client.completions.create(model=model, prompt="The model", temperature=0, max_tokens=12, logprobs=2,
                                  extra_body={"gamma": gamma})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [x.logprob for x in want.logprobs] and len(lp.tokens) == len(want.tokens)
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


@pytest.mark.parametrize("choice", ["required", "get_time"])
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_required_and_named(served, choice, stream):
    client, model, direct, gamma = served
    tc = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    kw = dict(model=model, messages=MSGS, tools=TOOLS, tool_choice=tc, temperature=0.8, seed=5, max_tokens=120,
              extra_body={"gamma": gamma})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        calls = _accumulate([t for c in chunks if c.choices and c.choices[0].delta.tool_calls
                             for t in c.choices[0].delta.tool_calls])
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    else:
        m = client.chat.completions.create(**kw).choices[0]
        calls, finish = m.message.tool_calls, [m.finish_reason]
        assert m.message.content is None
    assert finish == ["tool_calls"] and len(calls) == 1
    name = calls[0].function.name
    assert choice in ("required", name) and calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].function.arguments), _params(name))


def _accumulate(deltas):
    """Streamed ``tool_calls`` deltas (a call's id and name first, then its arguments in pieces, as OpenAI
    streams them) → the calls, in index order."""
    from types import SimpleNamespace as NS

    calls = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id and d.function.name, "a call's first delta has its id and name"
            calls[d.index] = NS(id=d.id, function=NS(name=d.function.name, arguments=""))
        else:
            assert d.id is None and not d.function.name
        calls[d.index].function.arguments += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def test_forced_call_cut_short_is_no_content_whole_or_streamed(served):
    """A forced call cut by max_tokens: finish 'length', no tool_calls and no half-JSON content, both ways."""
    client, model, _, gamma = served
    kw = dict(model=model, messages=MSGS, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=3,
              extra_body={"gamma": gamma})
    m = client.chat.completions.create(**kw).choices[0]
    assert (m.finish_reason, m.message.content, m.message.tool_calls) == ("length", None, None)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_tool_round_trip_and_auto(served):
    """A conversation holding a call and its result renders; 'auto' on a template without a tool format answers."""
    client, model, direct, gamma = served
    msgs = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, temperature=0, max_tokens=10)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=10)
    assert r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body,param", [
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nosuch"}}}],
          tool_choice="required"), "tools"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(logit_bias={"1": 5}), "logit_bias"),
])
def test_bad_structured_requests_are_400(served, body, param):
    client, model, _, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MSGS, max_tokens=4, **body)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and "\n" not in err["message"]
    if param:
        assert err["param"] == param
