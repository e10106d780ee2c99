"""Thinking split from the answer by ``ondevice serve``, through the real ``openai`` client.

A tiny random-weight model is served with a real family's chat template (its conventions copied as data);
a grammar (the ``grammar`` request field, Lark compiled by llguidance) forces outputs shaped like a
thinking model's (``<think>…</think>`` then an answer, or a call). Each answer is checked three ways: against
the same request decoded directly on a ``Runtime`` with plain decoding (γ = 0; the server speculates with
n-gram drafts, γ = 3), against the free parts of the forced text read back by a regex (independent of the
splitter), and streamed against whole.
"""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")

KEY = "k-reasoning"
MSGS = [{"role": "user", "content": "Weather in Paris? the cat sat on the mat"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
WORDS = r"/[a-z]{1,6}( [a-z]{1,6}){0,3}/"  # free text the model picks (bounded, so the forced end comes)

# Qwen3's conventions (its template's message loop and generation prompt): thinking in <think> tags at the
# start of the answer, reasoning_content rendered back, enable_thinking=false closing an empty block, Hermes
# calls in <tool_call> tags.
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system") %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.last and reasoning_content %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def templated(tiny_hf, tmp_path_factory, name: str, template: str):
    """A tiny GGUF (the qwen2 test model) whose chat template is ``template``."""
    import shutil

    from converters import convert

    src = tmp_path_factory.mktemp(name)
    shutil.copytree(tiny_hf["qwen2"], src / "hf")
    tc = json.loads((src / "hf" / "tokenizer_config.json").read_text())
    tc["chat_template"] = template
    (src / "hf" / "tokenizer_config.json").write_text(json.dumps(tc))
    convert(src / "hf", to="gguf", out=src / "gguf", quant="q8_0", progress=False)
    return str(src / "gguf" / "model.gguf")


class Served:
    """A server (n-gram drafts) and a direct runtime on the same model file."""

    def __init__(self, path: str) -> None:
        from ondevice.loader import load
        from ondevice.server.run import launch

        self.proc, url = launch(path, "--n-ctx", "1024", "--threads", "1", api_key=KEY)
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id
        self.direct = load(path, drafter="none", n_ctx=1024, threads=1)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.direct.close()

    def plain(self, grammar: str, messages=MSGS, tools=None, variables=None) -> str:
        """The forced answer decoded directly, greedy, without speculation (the prompt rendered as the
        server renders it)."""
        from ondevice.chat import render_prompt
        from ondevice.toolcalls import detect, template_messages

        msgs = template_messages(messages, detect(self.direct.target.chat_template))
        ids = render_prompt(self.direct, msgs, tools=tools, variables=variables)[1]
        return self.direct.generate(ids, temperature=0, max_tokens=200, gamma=0, grammar=grammar).text

    def ask(self, grammar: str, messages=MSGS, **kw):
        """(whole message, finish reason, streamed message fields, streamed finish reason), greedy, γ = 3."""
        extra = {"gamma": 3, "grammar": grammar, **kw.pop("extra_body", {})}
        args = dict(model=self.model, messages=messages, temperature=0, max_tokens=200, extra_body=extra, **kw)
        r = self.client.chat.completions.create(**args).choices[0]
        chunks = list(self.client.chat.completions.create(stream=True, **args))
        return r.message, r.finish_reason, streamed(chunks), [c.choices[0].finish_reason for c in chunks
                                                              if c.choices and c.choices[0].finish_reason]


def streamed(chunks) -> dict:
    """A stream's deltas put together: content, reasoning_content, reasoning and the calls (id, name and
    arguments, accumulated by index as OpenAI streams them)."""
    out = {"content": "", "reasoning_content": "", "reasoning": "", "calls": {}}
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        out["content"] += d.content or ""
        extra = d.model_extra or {}
        for k in ("reasoning_content", "reasoning"):
            out[k] += extra.get(k) or ""
        for t in d.tool_calls or []:
            call = out["calls"].setdefault(t.index, {"id": t.id, "name": t.function.name, "arguments": ""})
            call["arguments"] += t.function.arguments or ""
    out["calls"] = [out["calls"][i] for i in sorted(out["calls"])]
    return out


def whole_calls(msg) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []]


@pytest.fixture(scope="module")
def qwen3(tiny_hf, tmp_path_factory):
    s = Served(templated(tiny_hf, tmp_path_factory, "qwen3", QWEN3))
    yield s
    s.close()


def test_think_then_answer_split_whole_and_streamed(qwen3):
    grammar = f'start: "<think>\\n" {WORDS} "\\n</think>\\n\\n" {WORDS}'
    want = qwen3.plain(grammar)
    m = re.fullmatch(r"<think>\n(.*)\n</think>\n\n(.*)", want, re.DOTALL)
    assert m, want
    msg, finish, st, st_finish = qwen3.ask(grammar)
    extra = msg.model_extra
    assert (extra["reasoning_content"], extra["reasoning"], msg.content) == ("\n" + m[1] + "\n", "\n" + m[1] + "\n", m[2])
    assert (st["reasoning_content"], st["reasoning"], st["content"]) == (extra["reasoning_content"],) * 2 + (m[2],)
    assert finish == "stop" and st_finish == ["stop"] and not st["calls"]
    assert "<think>" not in msg.content and "</think>" not in st["content"]
    msg, _, st, _ = qwen3.ask(grammar, extra_body={"reasoning_format": "none"})  # llama-server's: tags kept
    assert msg.content == st["content"] == want and "reasoning_content" not in msg.model_extra


def test_python_api_reply_splits_as_the_server(qwen3):
    from ondevice.chat import reply

    grammar = (f'start: "<think>\\n" {WORDS} "\\n</think>\\n\\n" {WORDS} "\\n<tool_call>\\n{{\\"name\\": '
               f'\\"get_weather\\", \\"arguments\\": {{\\"city\\": \\"" /[A-Z][a-z]{{1,7}}/ "\\"}}}}\\n</tool_call>"')
    r = reply(qwen3.direct, MSGS, tools=[WEATHER], grammar=grammar, temperature=0, max_tokens=200, gamma=0)
    msg, *_ = qwen3.ask(grammar, tools=[WEATHER])
    assert r.reasoning == msg.model_extra["reasoning_content"] and r.reasoning.strip()
    assert r.content == msg.content and r.content.strip() and "<" not in r.content
    assert [c["function"] for c in r.tool_calls] == [c.function.model_dump() for c in msg.tool_calls]
    assert r.result.text.startswith("<think>")
    off = reply(qwen3.direct, MSGS, template_kwargs={"enable_thinking": False}, max_tokens=1, temperature=0)
    on = reply(qwen3.direct, MSGS, max_tokens=1, temperature=0)
    assert off.result.stats.prompt_tokens > on.result.stats.prompt_tokens  # the closed empty block


def test_think_then_tool_call(qwen3):
    grammar = (f'start: "<think>\\n" {WORDS} "\\n</think>\\n\\n<tool_call>\\n{{\\"name\\": \\"get_weather\\", '
               f'\\"arguments\\": {{\\"city\\": \\"" /[A-Z][a-z]{{1,7}}/ "\\"}}}}\\n</tool_call>"')
    want = qwen3.plain(grammar, tools=[WEATHER])
    city = re.search(r'"city": "(\w+)"', want)[1]
    msg, finish, st, st_finish = qwen3.ask(grammar, tools=[WEATHER])
    assert msg.content is None and st["content"] == "" and finish == "tool_calls" and st_finish == ["tool_calls"]
    assert msg.model_extra["reasoning_content"] == st["reasoning_content"] == want.split("</think>")[0][len("<think>"):]
    assert [(c["name"], json.loads(c["arguments"])) for c in whole_calls(msg)] == [("get_weather", {"city": city})]
    assert [(c["name"], json.loads(c["arguments"])) for c in st["calls"]] == [("get_weather", {"city": city})]


def test_no_thinking_is_plain_content_and_template_kwargs_reach_the_template(qwen3):
    """enable_thinking=false renders the closed empty block (a longer prompt); the answer is all content,
    and a '<think>' later in it is text."""
    grammar = f'start: {WORDS} " <think> " {WORDS}'
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    want = qwen3.plain(grammar, variables={"enable_thinking": False})
    msg, finish, st, _ = qwen3.ask(grammar, extra_body=kw)
    assert msg.content == st["content"] == want and "reasoning_content" not in msg.model_extra
    assert st["reasoning_content"] == ""
    on = qwen3.client.chat.completions.create(model=qwen3.model, messages=MSGS, max_tokens=1)
    off = qwen3.client.chat.completions.create(model=qwen3.model, messages=MSGS, max_tokens=1, extra_body=kw)
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


def test_history_with_reasoning_and_calls_renders(qwen3):
    msgs = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    r = qwen3.client.chat.completions.create(model=qwen3.model, messages=msgs, tools=[WEATHER], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # an assistant turn's thinking (reasoning_content, or reasoning) reaches the template, which renders it
    sizes = []
    for extra in ({}, {"reasoning_content": "one two three four"}, {"reasoning": "one two three four"}):
        last = [*MSGS, {"role": "assistant", "content": "Sunny.", **extra}]
        sizes.append(qwen3.client.chat.completions.create(model=qwen3.model, messages=last, max_tokens=1).usage.prompt_tokens)
    assert sizes[0] < sizes[1] == sizes[2]
    with pytest.raises(openai.BadRequestError):
        qwen3.client.chat.completions.create(model=qwen3.model, max_tokens=1, messages=[
            *MSGS, {"role": "assistant", "content": "x", "reasoning_content": 3}])


@pytest.mark.parametrize("body,param", [
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"grammar": ""}, "grammar"),
    ({"reasoning_format": "hidden"}, "reasoning_format"),
    ({"grammar": 'start: "a"', "response_format": {"type": "json_object"}}, "grammar"),
])
def test_bad_fields_are_400_naming_them(qwen3, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        qwen3.client.chat.completions.create(model=qwen3.model, messages=MSGS, max_tokens=2, extra_body=body)
    assert e.value.body["param"] == param


def test_repl_folds_thinking_and_keeps_only_the_answer(qwen3, monkeypatch, capsys):
    """``ondevice chat`` (piped): the answer on stdout without thinking, a folded line on stderr,
    /thinking prints the thinking, /think off reaches the template (a longer prompt), the history keeps
    only the answer."""
    import io

    from ondevice.chat import ChatSession
    from ondevice.cli import repl
    from ondevice.params import GenerateRequest

    grammar = f'start: "<think>\\n" {WORDS} "\\n</think>\\n\\n" {WORDS}'
    want = qwen3.plain(grammar, messages=[{"role": "user", "content": "hello"}])
    thought, answer = re.fullmatch(r"<think>\n(.*)\n</think>\n\n(.*)", want, re.DOTALL).groups()
    sessions = []
    monkeypatch.setattr(repl, "ChatSession", lambda *a, **k: sessions.append(ChatSession(*a, **k)) or sessions[-1])
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"hello\n/thinking\n/think off\nagain\n")))
    req = GenerateRequest.of(grammar=grammar, temperature=0, max_tokens=200, gamma=0)
    assert repl.run_chat(qwen3.direct, system=None, show_draft=False, show_stats=False, request=req, title="t") == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == answer and "think" not in out
    assert f"thought for {len(thought.split())} words" in err and thought in err
    s = sessions[0]
    assert s.variables == {"enable_thinking": False} and s.turns[0] == ("hello", answer)
    from ondevice.chat import render_prompt

    assert "<think>\n\n</think>" in render_prompt(qwen3.direct, s.messages("again"), variables=s.variables)[0]
