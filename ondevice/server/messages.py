"""The Anthropic Messages dialect (``POST /v1/messages`` and ``/v1/messages/count_tokens``).

Request: ``system`` (a string or text blocks), ``messages`` (user / assistant turns whose content is a string
or blocks: text, ``tool_use`` in assistant turns, ``tool_result`` in user turns; a last assistant turn is a
prefill the answer continues), ``max_tokens`` (required), ``stop_sequences``, ``temperature`` / ``top_p`` /
``top_k`` (which the newest ``anthropic`` clients send through ``extra_body``), ``thinking`` (enabled / disabled:
the template variable ``enable_thinking``; ``budget_tokens``: thinking tokens at most on a thinking model, else
the server's ``--reasoning-budget``), ``output_config.format``
(a JSON schema the answer follows), ``grammar`` and ``gamma`` (ondevice's extensions), ``tools``
({name, description, input_schema}) and ``tool_choice`` (auto / any / tool / none). The
turns are rendered with the model's chat template exactly as the OpenAI chat dialect renders the same
conversation (tool_use → an assistant's tool call, tool_result → a tool message).

Answer: a ``message`` object (``thinking`` when the template's model thinks, text and ``tool_use`` blocks, ``stop_reason`` end_turn / max_tokens /
stop_sequence / tool_use, ``usage``), or Anthropic's event stream (``event:`` lines): message_start,
content_block_start / content_block_delta (thinking_delta, text_delta, input_json_delta) /
content_block_stop per block, message_delta (stop_reason, usage),
message_stop. Errors: ``{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}``.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from ondevice import reasoning, toolcalls
from ondevice.chat import PROMPT_TAIL, render_prompt
from ondevice.errors import OndeviceError
from ondevice.server.engine import Piece
from ondevice.server.errors import ApiError
from ondevice.server.openai_api import check_context, check_model, generation_args
from ondevice.server.structured import (
    Answer,
    Structured,
    budget_args,
    cut_by_limit,
    grammar_args,
    response_format_args,
    tool_args,
)
from ondevice.server.types import Call, Dialect, Reply
from ondevice.speculative import Stats

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}
STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens", "context": "max_tokens"}
_REFUSED = ("container", "mcp_servers")  # would change the answer if honoured


def anthropic_error(e: ApiError) -> dict:
    """``e`` in Anthropic's error shape."""
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(e)}}


def _bad(param: str, rule: str) -> ApiError:
    return ApiError(400, f"{param}: {rule}", param=param, code="invalid_value")


def _text(content: Any, where: str) -> str:
    """A string or a list of text blocks (joined by blank lines), as ``system`` and tool results give text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, b in enumerate(content):
            if isinstance(b, dict) and b.get("type") == "text" and not isinstance(b.get("text"), str):
                raise _bad(f"{where}[{i}].text", f"must be a string, not {type(b.get('text')).__name__}")
            if not (isinstance(b, dict) and b.get("type") == "text"):
                kind = b.get("type") if isinstance(b, dict) else type(b).__name__
                raise _bad(f"{where}[{i}]", f"a block of type {kind!r} is not supported here (text blocks only)")
            parts.append(b["text"])
        return "\n\n".join(parts)
    raise _bad(where, f"must be a string or a list of text blocks, not {type(content).__name__}")


def _turn(i: int, m: Any) -> list[dict]:
    """One Anthropic turn → the OpenAI-style messages the chat template takes (tool results first)."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise _bad(f"messages[{i}]", "must be {'role': 'user' | 'assistant', 'content': ...}")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"messages[{i}].content", "must be a string or a list of content blocks")
    texts, calls, results = [], [], []
    for j, b in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "text":
            raise _bad(where + ".text", f"must be a string, not {type(b.get('text')).__name__}")
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise _bad(where, "a tool_use block needs 'id', 'name' and an 'input' object")
            calls.append({"id": str(b.get("id", "")), "type": "function",
                          "function": {"name": b["name"], "arguments": b.get("input", {})}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad(where, "a tool_result block needs 'tool_use_id'")
            text = _text(b.get("content"), where + ".content")
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": ("Error: " + text) if b.get("is_error") else text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not shown to the model again, as Anthropic's own API does
        else:
            raise _bad(where, f"a block of type {kind!r} is not supported in a {role} turn (text, tool_use in "
                       "assistant turns, tool_result in user turns)")
    out = results
    if texts or calls or not results:
        out = [*out, {"role": role, "content": "\n\n".join(texts), **({"tool_calls": calls} if calls else {})}]
    return out


def conversation(body: dict) -> tuple[list[dict], str]:
    """(the messages for the chat template, the assistant prefill: "" unless the last turn is the assistant's)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list of {role, content} turns")
    out = []
    system = _text(body.get("system"), "system")
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(msgs):
        out += _turn(i, m)
    prefill = ""
    if out[-1]["role"] == "assistant":
        if out[-1].get("tool_calls"):
            raise _bad("messages", "the last turn is an assistant's tool_use: send the tool_result in a user turn")
        prefill = out.pop()["content"]
    return out, prefill


def _tools(body: dict, chat_template: str | None, st: Structured) -> None:
    """Anthropic ``tools`` / ``tool_choice`` → the OpenAI fields ``structured.tool_args`` checks and applies."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    oa: dict[str, Any] = {}
    if tools is not None and tools != []:  # an empty list (SDKs send one) is no tools, not an error
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list of {name, description, input_schema} objects")
        oa["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise _bad(f"tools[{i}]", f"tool type {kind!r} is not supported (client tools with input_schema only)")
            fn = {"name": t.get("name"), "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            oa["tools"].append({"type": "function", "function": fn})
    if choice is not None:
        choice_type = choice.get("type") if isinstance(choice, dict) else None
        if choice_type not in ("auto", "any", "tool", "none"):
            raise _bad("tool_choice", "must be {'type': 'auto' | 'any' | 'tool' | 'none'} ('tool' with 'name')")
        oa["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice_type) or {
            "type": "function", "function": {"name": choice.get("name")}}
    tool_args(oa, chat_template, st)


def _thinking(body: dict, st: Structured) -> None:
    """``thinking`` ({"type": "enabled", "budget_tokens": N} | {"type": "disabled"}) → the template variable
    ``enable_thinking`` (Qwen3's and others'; a template without it thinks as it always does)."""
    v = body.get("thinking")
    if v is None:
        return
    if not isinstance(v, dict) or v.get("type") not in ("enabled", "disabled"):
        raise _bad("thinking", "must be {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}")
    b = v.get("budget_tokens")
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
        raise _bad("thinking.budget_tokens", f"must be a positive integer (thinking tokens), not {b!r}")
    st.variables["enable_thinking"] = v["type"] == "enabled"


def _output_format(body: dict, st: Structured) -> None:
    """``output_config.format`` ({"type": "json_schema", "schema": {...}}) → a constrained answer."""
    oc = body.get("output_config")
    if oc is None:
        return
    fmt = oc.get("format") if isinstance(oc, dict) else None
    if fmt is None:
        return  # effort: there is no reasoning to spend it on
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format", "must be {'type': 'json_schema', 'schema': {...}}")
    response_format_args({"response_format": {"type": "json_schema", "json_schema": {
        "name": "output", "schema": fmt["schema"], "strict": True}}}, st)


def _generation(body: dict, n_prompt: int, n_ctx: int):
    mt = body.get("max_tokens")
    if mt is None:
        raise ApiError(400, "max_tokens: Field required", param="max_tokens", code="missing_required_parameter")
    t = body.get("temperature")
    if isinstance(t, int | float) and not isinstance(t, bool) and not 0 <= t <= 1:
        raise _bad("temperature", f"{t!r} is out of range [0, 1]")
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise _bad("stop_sequences", "must be a list of strings")
    oa = {"max_tokens": mt, "stop": stops, **{k: body.get(k) for k in ("temperature", "top_p", "top_k", "seed",
                                                                       "min_p", "repetition_penalty")}}
    if "gamma" in body:  # ondevice's extension, as in the OpenAI dialects
        oa["gamma"] = body["gamma"]
    return generation_args(oa, n_prompt, n_ctx)


class Messages(Dialect):
    path = "/v1/messages"

    @classmethod
    def error(cls, e: ApiError) -> dict:
        return anthropic_error(e)

    def prompt(self, body: dict) -> tuple[list[int], Structured]:
        """The prompt's token ids (template, tools and prefill) and the structured fields, checked."""
        rt = self.ctx.rt
        if body.get("model") is None:
            raise ApiError(400, f"model: Field required; this server serves {self.ctx.model_id!r}", param="model")
        check_model(body.get("model"), self.ctx.model_id)
        for k in _REFUSED:
            if body.get(k):
                raise _bad(k, "is not supported by this server")
        msgs, prefill = conversation(body)
        st = Structured()
        _thinking(body, st)
        _output_format(body, st)
        grammar_args(body, st)  # ondevice's extension, as on /v1/chat/completions
        template = rt.target.chat_template
        _tools(body, template, st)
        try:  # the template is untrusted: it renders in its own budgeted process
            text, ids = render_prompt(rt, toolcalls.template_messages(msgs, st.family), tools=st.tools,
                                      variables=st.variables)
            if prefill:
                ids += rt.tokenize(prefill, add_bos=False)
        except OndeviceError as e:
            raise ApiError(400, str(e), param="messages") from e
        st.thinking = reasoning.detect(template, (text + prefill)[-PROMPT_TAIL:])
        think = body.get("thinking") or {}
        b = think.get("budget_tokens") if think.get("type") == "enabled" and st.thinking else None
        budget_args({} if b is None else {"reasoning_budget": b}, st.thinking, rt.reasoning_budget, st)
        return ids, st

    def parse(self, body: dict) -> Call:
        rt = self.ctx.rt
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("stream", "must be true or false")
        ids, st = self.prompt(body)
        check_context(len(ids), rt.n_ctx)
        req = dataclasses.replace(_generation(body, len(ids), rt.n_ctx), **st.run)
        return Call(ids, req, MessageReply(self.ctx.model_id, len(ids), st, req.stop), stream)

    def count_tokens(self, body: dict) -> dict:
        """``/v1/messages/count_tokens``: {"input_tokens": N} of the prompt ``parse`` would run."""
        return {"input_tokens": len(self.prompt(body)[0])}


class MessageReply(Reply):
    """An answer as an Anthropic ``message``: thinking, text and tool_use blocks (``structured.Answer``), whole
    or as the event stream."""

    def __init__(self, model: str, n_prompt: int, st: Structured, stops) -> None:
        self.model, self.n_prompt, self.st = model, n_prompt, st
        self.stop = stops[0] if len(stops) == 1 else None  # which of several ended it is not known
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.out = Answer(st)
        self.index = -1  # the last content block
        self.open: str | None = None  # the type of the open block: 'thinking' | 'text'

    def encode(self, event: dict) -> bytes:
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event['type']}\ndata: {data}\n\n".encode()

    def error(self, e: ApiError) -> dict:
        return anthropic_error(e)

    def _finish(self, stats: Stats, calls: list) -> dict:
        reason = "tool_use" if calls else STOP_REASONS.get(stats.stop_reason, "end_turn")
        return {"stop_reason": reason, "stop_sequence": self.stop if reason == "stop_sequence" else None}

    def _usage(self, stats: Stats) -> dict:
        return {"input_tokens": stats.prompt_tokens, "output_tokens": stats.tokens,
                "cache_read_input_tokens": stats.prompt_tokens - stats.prompt_eval_tokens,
                "cache_creation_input_tokens": 0}

    def whole(self, pieces: list[Piece], stats: Stats) -> dict:
        self.out.feed("".join(p.chunk.text for p in pieces))
        self.out.finish(cut_by_limit(stats))
        thinking, text, calls = self.out.result()
        content = ([{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []) + (
            [{"type": "text", "text": text}] if text else []) + [_tool_use(c) for c in calls]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                **self._finish(stats, calls), "usage": self._usage(stats), "ondevice": dataclasses.asdict(stats)}

    def opening(self) -> list[dict]:
        return [{"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": self.n_prompt, "output_tokens": 0}}}]

    def _block(self, kind: str, text: str) -> list[dict]:
        """A delta of a 'thinking' or 'text' block, the previous block closed and this one opened as needed."""
        out = []
        if self.open != kind:
            out += self._close()
            self.index += 1
            self.open = kind
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
            out.append({"type": "content_block_start", "index": self.index, "content_block": block})
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}
        return [*out, {"type": "content_block_delta", "index": self.index, "delta": delta}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _events(self, deltas: list[dict]) -> list[dict]:
        """``Answer``'s deltas as events (tool calls are sent whole at the end: ``closing``)."""
        out = []
        for d in deltas:
            if d.get("reasoning_content"):
                out += self._block("thinking", d["reasoning_content"])
            if d.get("content"):
                out += self._block("text", d["content"])
        return out

    def piece(self, piece: Piece) -> list[dict]:
        return self._events(self.out.feed(piece.chunk.text))

    def closing(self, stats: Stats) -> list[dict]:
        out = self._events(self.out.finish(cut_by_limit(stats)))
        calls = self.out.result()[2]
        out += self._close()
        for c in calls:
            self.index += 1
            block = _tool_use(c)
            out += [{"type": "content_block_start", "index": self.index, "content_block": {**block, "input": {}}},
                    {"type": "content_block_delta", "index": self.index,
                     "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}},
                    {"type": "content_block_stop", "index": self.index}]
        return [*out, {"type": "message_delta", "delta": self._finish(stats, calls),
                       "usage": {"output_tokens": stats.tokens}, "ondevice": dataclasses.asdict(stats)},
                {"type": "message_stop"}]


def _tool_use(call: dict) -> dict:
    """An OpenAI tool call (``structured.Answer``) as a ``tool_use`` block."""
    fn = call["function"]
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": fn["name"],
            "input": json.loads(fn["arguments"])}
