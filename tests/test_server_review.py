"""Regressions found reviewing #39 as a user (hostile bodies, several models on demand)."""

from __future__ import annotations

import asyncio

import pytest


class _FakeRuntime:
    drafter = None
    n_ctx = 64

    class target:  # noqa: N801
        vocab_size = 8

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def close(self) -> None:
        self.log.append(("close", self.name))


def test_a_waiting_request_loads_once_the_other_models_job_has_closed():
    """max_loaded 1: a request for b waits while a's lease is released but a's engine is still closing its
    job (the lease ends before the engine's lock does); once the job closes, b must load at once, not after
    a's keep_alive (the hang seen with `serve A B --max-loaded 1` and two clients)."""
    from ondevice.server.models import Models

    log: list = []

    async def main() -> None:
        ms = Models([("a", "a"), ("b", "b")], lambda s: (log.append(("load", s)), _FakeRuntime(s, log))[1],
                    max_loaded=1, keep_alive=300)
        held = await ms.acquire("a")
        lock = held.engine._lock
        await lock.acquire()  # a's job is still running
        waiting = asyncio.ensure_future(ms.acquire("b"))
        await asyncio.sleep(0.2)
        held.release()  # the lease ends first ...
        await asyncio.sleep(0.2)
        lock.release()  # ... then the job closes
        other = await asyncio.wait_for(waiting, 5)
        assert other.model_id == "b" and log == [("load", "a"), ("close", "a"), ("load", "b")]
        other.release()
        ms.close()

    asyncio.run(main())


def test_a_deeply_nested_body_is_a_400_not_a_500():
    """'[[[[...' deeper than Python's recursion limit: invalid JSON (400), not an internal error."""
    from ondevice.server.driver import read_body
    from ondevice.server.errors import ApiError

    class _Req:
        headers: dict = {}

        async def stream(self):
            yield b"[" * 100_000

    with pytest.raises(ApiError) as e:
        asyncio.run(read_body(_Req()))
    assert e.value.status == 400 and "nested too deeply" in str(e.value)


def test_a_text_block_whose_text_is_not_a_string_is_named_as_such():
    """{"type": "text", "text": 5} is a text block with a bad 'text', not an unsupported block type (the
    message said "a block of type 'text' is not supported", sending the user to the wrong fix)."""
    from ondevice.server.errors import ApiError
    from ondevice.server.messages import _text, _turn
    from ondevice.server.responses import _part_text

    calls = [(_turn, (0, {"role": "user", "content": [{"type": "text", "text": 5}]}), "messages[0].content[0].text"),
             (_text, ([{"type": "text", "text": None}], "system"), "system[0].text"),
             (_part_text, ([{"type": "input_text", "text": 5}], "input[0].content"), "input[0].content[0].text")]
    for fn, args, param in calls:
        with pytest.raises(ApiError) as e:
            fn(*args)
        assert e.value.param == param and "must be a string" in str(e.value) and "not supported" not in str(e.value)


def test_thinking_budget_and_text_format_errors_name_the_field_the_client_sent():
    """thinking.budget_tokens "x" was accepted silently; a bad Responses text.format was blamed on
    'response_format', a field the Responses API does not have."""
    from ondevice.server.errors import ApiError
    from ondevice.server.messages import _thinking
    from ondevice.server.responses import _structured
    from ondevice.server.structured import Structured

    with pytest.raises(ApiError) as e:
        _thinking({"thinking": {"type": "enabled", "budget_tokens": "x"}}, Structured())
    assert e.value.param == "thinking.budget_tokens"
    _thinking({"thinking": {"type": "enabled", "budget_tokens": 2048}}, Structured())  # still fine
    with pytest.raises(ApiError) as e:
        _structured({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, None, Structured())
    assert e.value.param == "text.format" and "response_format" not in str(e.value), str(e.value)


def test_an_empty_tools_list_is_no_tools_in_both_dialects():
    """tools: [] (which agent SDKs send when no tool is registered) was a 400 demanding a non-empty list of
    OpenAI-shaped tools, in the Anthropic dialect too."""
    from ondevice.server.messages import _tools
    from ondevice.server.responses import _structured
    from ondevice.server.structured import Structured

    st = Structured()
    _tools({"tools": []}, None, st)
    assert not st.tools
    st = Structured()
    _structured({"tools": []}, None, st)
    assert not st.tools
