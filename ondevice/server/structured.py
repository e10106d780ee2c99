"""OpenAI's structured-output fields: ``response_format``, ``tools`` / ``tool_choice``, ``logprobs`` / ``top_logprobs``.

Request side: ``structured_args`` validates them (``ApiError`` 400 in OpenAI's shape, naming the field) and
returns what the runtime and the reply need. Response side: ``chat_logprobs`` / ``completion_logprobs``
write ``TokenLogprob`` lists in OpenAI's two shapes, and ``ToolStream`` holds back streamed text from the
start of a tool call so calls arrive as ``tool_calls`` deltas, never as content.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ondevice import tools as T
from ondevice.constrain import grammar_text
from ondevice.errors import OndeviceError
from ondevice.logprobs import TokenLogprob
from ondevice.params import MAX_TOP_LOGPROBS
from ondevice.server.openai_api import ApiError


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


def structured_args(body: dict, chat: bool, chat_template: str | None) -> Structured:
    """Validate ``response_format``, ``tools``, ``tool_choice``, ``logprobs``, ``top_logprobs`` of a request.

    Args:
        body: the request JSON.
        chat: /v1/chat/completions (logprobs is a boolean there, an integer 0-5 for /v1/completions).
        chat_template: the model's template (which tool-call format it speaks).
    Raises:
        ApiError: 400 naming the field.
    """
    out = Structured()
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if lp not in (None, True, False):
            raise _bad("logprobs", "must be a boolean")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise _bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if top and not lp:
            raise _bad("top_logprobs", "needs 'logprobs': true")
        out.logprobs = bool(lp)
        n_top = top or 0
    else:
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 5):
            raise _bad("logprobs", "must be an integer in [0, 5] (alternatives per token)")
        out.logprobs = lp is not None
        n_top = lp or 0
    if out.logprobs:
        out.run.update(logprobs=True, top_logprobs=n_top)
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise _bad("response_format", "must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
        if rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise _bad("response_format", "json_schema needs {'name': ..., 'schema': {...}, 'strict': true}")
            rf = {"type": "json_schema", "json_schema": {**js, "schema": js.get("schema", {})}}
        if rf["type"] != "text":
            try:
                grammar_text(rf)  # a bad schema is a 400 naming response_format, before any decoding
            except OndeviceError as e:
                raise _bad("response_format", str(e)) from None
            out.run["response_format"] = rf
    tools = body.get("tools")
    if tools is not None and chat:
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
    elif tools is not None:
        raise _bad("tools", "tools are for /v1/chat/completions", code="unsupported_parameter")
    elif body.get("tool_choice") not in (None, "none", "auto"):
        raise _bad("tool_choice", "needs 'tools'")
    return out


def _bytes_entry(token_bytes: Callable[[int], bytes], tid: int, lp: float) -> dict:
    b = token_bytes(tid)
    return {"token": b.decode("utf-8", "replace"), "logprob": lp if math.isfinite(lp) else -9999.0, "bytes": list(b)}


def chat_logprobs(lps: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes]) -> dict:
    """``choices[i].logprobs`` of a chat completion: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    return {"content": [{**_bytes_entry(token_bytes, x.token, x.logprob),
                         "top_logprobs": [_bytes_entry(token_bytes, i, v) for i, v in x.top]} for x in lps],
            "refusal": None}


def completion_logprobs(lps: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes], offset: int = 0) -> dict:
    """``choices[i].logprobs`` of a text completion: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets = [], []
    for x in lps:
        offsets.append(offset)
        t = token_bytes(x.token).decode("utf-8", "replace")
        tokens.append(t)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{token_bytes(i).decode("utf-8", "replace"): v for i, v in x.top} for x in lps],
            "text_offset": offsets}


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


def tool_call_deltas(calls: Sequence[dict]) -> list[dict]:
    """Streamed ``delta.tool_calls`` entries (one per call, with its index)."""
    return [{"index": i, "id": c["id"], "type": "function", "function": dict(c["function"])} for i, c in enumerate(calls)]

