"""OpenAI's structured-output fields: ``response_format``, ``tools`` / ``tool_choice``, ``logprobs`` / ``top_logprobs``.

Request side: one function per field group (``chat_logprobs_args``, ``completion_logprobs_args``,
``response_format_args``, ``tool_args``, ``no_tool_args``) validates it (``ApiError`` 400 in OpenAI's shape,
naming the field) into a ``Structured``: what the runtime and the reply need; each dialect calls the ones it
speaks. Response side: ``ToolStream`` holds back streamed text from the start of a tool call so calls arrive
as tool calls, never as content.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from ondevice import tools as T
from ondevice.constrain import grammar_text
from ondevice.errors import OndeviceError
from ondevice.params import MAX_TOP_LOGPROBS
from ondevice.server.errors import ApiError

MAX_SCHEMA_CHARS = 200_000  # JSON of a response_format schema, or of all tools: about 1 s to compile on a laptop
MAX_TOOLS = 128  # as OpenAI


@dataclass
class Structured:
    """What a request's structured fields ask for.

    Attributes:
        run: extra keyword arguments for ``Runtime.stream`` (response_format / grammar, logprobs, top_logprobs).
        tools: the checked tools to render into the prompt (None: no tools, or tool_choice 'none').
        tool_format: 'hermes' | 'json' (``ondevice.tools.call_format``).
        logprobs: whether the reply carries logprobs.
    """

    run: dict = field(default_factory=dict)
    tools: list | None = None
    tool_format: str = "json"
    logprobs: bool = False


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"'{param}': {message}", param=param, code=code)


def chat_logprobs_args(body: dict, out: Structured) -> None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (an integer 0-20, needs logprobs)."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp not in (None, True, False):
        raise _bad("logprobs", "must be a boolean")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise _bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    if top and not lp:
        raise _bad("top_logprobs", "needs 'logprobs': true")
    _logprobs(out, bool(lp), top or 0)


def completion_logprobs_args(body: dict, out: Structured) -> None:
    """A text completion's ``logprobs``: an integer 0-5, the alternatives per token."""
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 5):
        raise _bad("logprobs", "must be an integer in [0, 5] (alternatives per token)")
    _logprobs(out, lp is not None, lp or 0)


def _logprobs(out: Structured, on: bool, n_top: int) -> None:
    out.logprobs = on
    if on:
        out.run.update(logprobs=True, top_logprobs=n_top)


def response_format_args(body: dict, out: Structured) -> None:
    """``response_format``: text, json_object or json_schema (compiled here: a bad schema is a 400)."""
    rf = body.get("response_format")
    if rf is None:
        return
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("response_format", "must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
    if rf["type"] == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise _bad("response_format", "json_schema needs {'name': ..., 'schema': {...}, 'strict': true}")
        rf = {"type": "json_schema", "json_schema": {**js, "schema": js.get("schema", {})}}
        _cap_size("response_format", "the schema", rf["json_schema"]["schema"])
    if rf["type"] != "text":
        try:
            grammar_text(rf)  # a bad schema is a 400 naming response_format, before any decoding
        except OndeviceError as e:
            raise _bad("response_format", str(e)) from None
        out.run["response_format"] = rf


def tool_args(body: dict, chat_template: str | None, out: Structured) -> None:
    """``tools`` and ``tool_choice``: the tools to render and, for 'required' or a named function, the grammar
    of one call (``chat_template``: the model's template, which says the call format)."""
    tools = body.get("tools")
    if tools is None:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise _bad("tool_choice", "needs 'tools'")
        return
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise _bad("tools", f"{len(tools)} tools given; the limit is {MAX_TOOLS} per request")
    _cap_size("tools", "the list of tools", tools)
    try:
        tools = T.check_tools(tools)
        choice = T.choice_of(body.get("tool_choice"), tools)
    except OndeviceError as e:
        raise _bad("tools" if "tool_choice" not in str(e) else "tool_choice", str(e)) from None
    if choice != "none":
        out.tools = tools
        out.tool_format = T.call_format(chat_template)
        if choice != "auto":
            if "response_format" in out.run:
                raise _bad("tool_choice", f"{choice!r} forces a tool call; it cannot be combined with response_format")
            out.run["grammar"] = T.call_grammar(tools, choice, out.tool_format)


def _cap_size(param: str, what: str, obj) -> None:
    n = len(json.dumps(obj, ensure_ascii=False))
    if n > MAX_SCHEMA_CHARS:
        raise _bad(param, f"{what} is {n:,} characters of JSON; the limit is {MAX_SCHEMA_CHARS:,} (a grammar is "
                   "compiled from it for every request): send a smaller one")


def no_tool_args(body: dict) -> None:
    """An API without tools: refuse ``tools`` and a ``tool_choice`` that asks for a call."""
    if body.get("tools") is not None:
        raise _bad("tools", "tools are for /v1/chat/completions", code="unsupported_parameter")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise _bad("tool_choice", "needs 'tools'")


class ToolStream:
    """Streamed text with tools: content goes out until a tool call may begin; calls are parsed at the end."""

    def __init__(self, fmt: str, tools: Sequence[dict], constrained: bool) -> None:
        self.fmt, self.tools = fmt, tools
        self.constrained = constrained  # the whole answer is a call: nothing is content
        self.text = ""
        self.sent = 0

    def feed(self, piece: str) -> str:
        """Add generated text; return the content that may be sent now."""
        self.text += piece
        if self.constrained:
            return ""
        end = max(T.held_back(self.text, self.fmt), self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content not yet sent, the tool calls found in the whole answer)."""
        before, calls, after = T.split_calls(self.text, self.fmt, self.tools)
        if self.constrained:
            return "", calls
        tail = (before[self.sent :] + after) if calls else self.text[self.sent :]
        self.sent = len(self.text)
        return tail, calls
