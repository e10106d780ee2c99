"""The OpenAI Responses dialect (``POST /v1/responses``).

Request: ``input`` (a string, or items: messages whose content is text or ``input_text`` / ``output_text``
parts, ``function_call`` and ``function_call_output`` items), ``instructions``, ``max_output_tokens``,
``temperature`` / ``top_p``, ``grammar`` and ``gamma`` (ondevice's extensions), function ``tools`` and
``tool_choice``, ``text.format`` (text, json_object,
json_schema), ``previous_response_id`` (the conversation of a stored response continues: the last
``MAX_STORED`` answers with ``store`` not false are kept in memory, never on disk). ``reasoning.effort``: a
thinking budget (``structured.EFFORT_BUDGETS``) on a model whose template thinks, else the server's
``--reasoning-budget``.

Answer: a ``response`` object (``reasoning`` items when the template's model thinks, ``message`` and
``function_call`` output items, ``status`` completed or incomplete, ``usage``), or its event stream:
response.created, response.in_progress, per item response.output_item.added, (response.content_part.added,
response.reasoning_text.delta... / response.output_text.delta..., their .done, response.content_part.done |
response.function_call_arguments.delta / .done), response.output_item.done, then response.completed (or
response.incomplete at the token limit).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

from ondevice import reasoning, toolcalls
from ondevice.chat import PROMPT_TAIL, render_prompt
from ondevice.errors import OndeviceError
from ondevice.server.engine import Piece
from ondevice.server.errors import ApiError
from ondevice.server.openai_api import check_context, generation_args, stream_args
from ondevice.server.structured import (
    EFFORT_BUDGETS,
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

MAX_STORED = 64  # responses kept for previous_response_id (least recently used dropped)
MAX_STORED_CHARS = 1 << 20  # a longer conversation is answered but not kept
_REFUSED = ("background", "conversation", "prompt")  # would change what is answered if honoured


def _bad(param: str, rule: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"'{param}': {rule}", param=param, code=code)


class Store:
    """The conversations of the last ``MAX_STORED`` responses (thread-safe LRU, in memory only)."""

    def __init__(self, size: int = MAX_STORED) -> None:
        self.size = size
        self._items: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, rid: str) -> list[dict]:
        with self._lock:
            if rid not in self._items:
                raise ApiError(404, f"previous_response_id {rid!r} is not known here (this server keeps the last "
                               f"{self.size} responses in memory, and none across restarts); send the whole input",
                               param="previous_response_id", code="previous_response_not_found")
            self._items.move_to_end(rid)
            return list(self._items[rid])

    def put(self, rid: str, messages: list[dict]) -> None:
        if len(json.dumps(messages, ensure_ascii=False)) > MAX_STORED_CHARS:
            return
        with self._lock:
            self._items[rid] = messages
            while len(self._items) > self.size:
                self._items.popitem(last=False)


def _part_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of input_text parts")
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        if kind in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
            parts.append(p["text"])
        elif kind in ("input_text", "output_text", "text"):
            raise _bad(f"{where}[{j}].text", f"must be a string, not {type(p.get('text')).__name__}")
        elif kind != "refusal":
            raise _bad(f"{where}[{j}]", f"a part of type {kind!r} is not supported (text only)",
                       code="unsupported_value")
    return "".join(parts)


def input_messages(body: dict) -> list[dict]:
    """``input`` → chat messages (a ``function_call`` joins the assistant turn before it)."""
    inp = body.get("input")
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise _bad("input", "must be a string or a non-empty list of items")
    out: list[dict] = []
    for i, it in enumerate(inp):
        where = f"input[{i}]"
        kind = it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message" and it.get("role") in ("user", "assistant", "system", "developer"):
            role = "system" if it["role"] == "developer" else it["role"]
            out.append({"role": role, "content": _part_text(it.get("content"), where + ".content")})
        elif kind == "function_call":
            if not all(isinstance(it.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _bad(where, "a function_call item needs 'call_id', 'name' and 'arguments' strings")
            call = {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise _bad(where, "a function_call_output item needs 'call_id'")
            out.append({"role": "tool", "tool_call_id": it["call_id"],
                        "content": _part_text(it.get("output"), where + ".output")})
        elif kind == "reasoning":
            continue
        else:
            raise _bad(where, f"an item of type {kind!r} is not supported (message with role user / assistant / "
                       "system / developer, function_call, function_call_output)", code="unsupported_value")
    return out


def _effort(body: dict) -> str | None:
    """``reasoning`` ({"effort": "none" | "minimal" | "low" | "medium" | "high", "summary": ...}): the effort."""
    r = body.get("reasoning")
    if r is None:
        return None
    effort = r.get("effort") if isinstance(r, dict) else None
    if not isinstance(r, dict) or (effort is not None and effort not in EFFORT_BUDGETS):
        raise _bad("reasoning.effort", f"must be one of {', '.join(EFFORT_BUDGETS)} (in {{'effort': ...}})")
    return effort


def _structured(body: dict, chat_template: str | None, st: Structured) -> None:
    """``text.format``, ``tools`` and ``tool_choice`` in the chat shapes ``structured`` checks."""
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if text is not None and not isinstance(text, dict):
        raise _bad("text", "must be an object such as {'format': {'type': 'json_schema', ...}}")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise _bad("text.format", "must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
        rf = dict(fmt)
        if fmt.get("type") == "json_schema":
            rf = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        try:
            response_format_args({"response_format": rf}, st)
        except ApiError as e:  # the client sent text.format: name it, not chat's response_format
            raise ApiError(e.status, str(e).replace("'response_format'", "'text.format'"),
                           param="text.format", code=e.code) from None
    grammar_args(body, st)  # ondevice's extension, as on /v1/chat/completions
    tools, choice = body.get("tools"), body.get("tool_choice")
    oa: dict[str, Any] = {}
    if tools is not None and tools != []:  # an empty list (SDKs send one) is no tools, not an error
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list of function tools")
        oa["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise _bad(f"tools[{i}]", f"tool type {kind!r} is not supported (function tools only)",
                           code="unsupported_value")
            oa["tools"].append({"type": "function", "function": {k: t[k] for k in ("name", "description",
                                                                                    "parameters") if k in t}})
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        oa["tool_choice"] = choice
    tool_args(oa, chat_template, st)


class Responses(Dialect):
    path = "/v1/responses"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.store = ctx.shared.setdefault("responses", Store())  # one per server, whichever model answers

    def parse(self, body: dict) -> Call:
        rt = self.ctx.rt
        stream, _ = stream_args(body, self.ctx.model_id)
        for k in _REFUSED:
            if body.get(k):
                raise _bad(k, "is not supported by this server", code="unsupported_parameter")
        if body.get("top_logprobs"):
            raise _bad("top_logprobs", "is not supported on /v1/responses; use /v1/chat/completions",
                       code="unsupported_parameter")
        store = body.get("store", True)
        if not isinstance(store, bool):
            raise _bad("store", "must be true or false")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise _bad("instructions", "must be a string")
        prev = body.get("previous_response_id")
        if prev is not None and not isinstance(prev, str):
            raise _bad("previous_response_id", "must be a string")
        conv = [*(self.store.get(prev) if prev else []), *input_messages(body)]
        st = Structured()
        template = rt.target.chat_template
        _structured(body, template, st)
        effort = _effort(body)
        msgs = ([{"role": "system", "content": instructions}] if instructions else []) + conv
        try:  # the template is untrusted: it renders in its own budgeted process
            text, ids = render_prompt(rt, toolcalls.template_messages(msgs, st.family), tools=st.tools)
        except OndeviceError as e:
            raise ApiError(400, str(e), param="input") from e
        st.thinking = reasoning.detect(template, text[-PROMPT_TAIL:])
        budget_args({"reasoning_effort": effort} if effort is not None else {}, st.thinking, rt.reasoning_budget, st)
        check_context(len(ids), rt.n_ctx)
        oa = {"max_tokens": body.get("max_output_tokens"),
              **{k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "gamma")
                 if k in body}}
        req = dataclasses.replace(generation_args(oa, len(ids), rt.n_ctx), **st.run)
        echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
                "previous_response_id": prev, "store": store, "temperature": body.get("temperature"),
                "top_p": body.get("top_p"), "tool_choice": body.get("tool_choice", "auto"),
                "tools": body.get("tools") or [], "text": {"format": (body.get("text") or {}).get("format")
                                                            or {"type": "text"}},
                "metadata": body.get("metadata") or {}, "parallel_tool_calls": True, "truncation": "disabled",
                "reasoning": {"effort": effort, "summary": None}}
        keep = (lambda rid, out: self.store.put(rid, [*conv, *out])) if store else None
        return Call(ids, req, ResponseReply(self.ctx.model_id, echo, st, keep), stream)


def _usage(s: Stats) -> dict:
    return {"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.prompt_tokens - s.prompt_eval_tokens},
            "output_tokens": s.tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": s.prompt_tokens + s.tokens}


class ResponseReply(Reply):
    """A ``response`` object (thinking, content and calls: ``structured.Answer``), whole or as its event stream
    (``sequence_number`` on every event)."""

    def __init__(self, model: str, echo: dict, st: Structured, keep) -> None:
        self.model, self.echo, self.st, self.keep = model, echo, st, keep
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.out = Answer(st)
        self.seq = 0
        self.items: list[dict] = []  # the finished output items
        self.open: dict | None = None  # the streamed reasoning or message item, its text so far in "text"

    def encode(self, event: dict) -> bytes:
        if event.get("type", "").startswith("response."):
            event = {**event, "sequence_number": self.seq}
            self.seq += 1
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event.get('type', 'error')}\ndata: {data}\n\n".encode()

    def error(self, e: ApiError) -> dict:
        return {"type": "error", **e.body()}  # in a stream the openai client raises on the "error" key

    def _response(self, status: str, output: list[dict], stats: Stats | None) -> dict:
        incomplete = None
        if stats is not None and status != "in_progress" and stats.stop_reason in ("length", "context"):
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": incomplete, "model": self.model, "output": output, **self.echo,
                "usage": _usage(stats) if stats is not None else None,
                **({"ondevice": dataclasses.asdict(stats)} if stats is not None else {})}

    @staticmethod
    def _item(kind: str, item_id: str, text: str, status: str = "completed") -> dict:
        """A 'reasoning' or 'message' output item holding ``text`` (no content while in progress)."""
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                    "content": [part] if status == "completed" else []}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [part] if status == "completed" else []}

    def _finished(self, calls: list[dict], stats: Stats) -> dict:
        """The final response (``self.items`` and the calls); the conversation is kept for previous_response_id."""
        self.items += [_function_call(c) for c in calls]
        if self.keep is not None:
            text = "".join(it["content"][0]["text"] for it in self.items if it["type"] == "message")
            self.keep(self.id, [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}])
        return self._response("completed", self.items, stats)

    def whole(self, pieces: list[Piece], stats: Stats) -> dict:
        self.out.feed("".join(p.chunk.text for p in pieces))
        self.out.finish(cut_by_limit(stats))
        thinking, text, calls = self.out.result()
        if thinking:
            self.items.append(self._item("reasoning", "rs_" + uuid.uuid4().hex[:24], thinking))
        if text:
            self.items.append(self._item("message", "msg_" + uuid.uuid4().hex[:24], text))
        return self._finished(calls, stats)

    def opening(self) -> list[dict]:
        r = self._response("in_progress", [], None)
        return [{"type": "response.created", "response": r}, {"type": "response.in_progress", "response": r}]

    def _delta(self, kind: str, text: str) -> list[dict]:
        """A text delta of a 'reasoning' or 'message' item, the previous item closed and this one opened as
        needed."""
        out = []
        if self.open is None or self.open["kind"] != kind:
            out += self._close()
            item_id = ("rs_" if kind == "reasoning" else "msg_") + uuid.uuid4().hex[:24]
            self.open = {"kind": kind, "id": item_id, "text": ""}
            part = self._item(kind, item_id, "")["content"][0]
            at = {"item_id": item_id, "output_index": len(self.items)}
            out += [{"type": "response.output_item.added", "output_index": len(self.items),
                     "item": self._item(kind, item_id, "", "in_progress")},
                    {"type": "response.content_part.added", **at, "content_index": 0, "part": part}]
        self.open["text"] += text
        at = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
        if kind == "reasoning":
            return [*out, {"type": "response.reasoning_text.delta", **at, "delta": text}]
        return [*out, {"type": "response.output_text.delta", **at, "delta": text, "logprobs": []}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        o, self.open = self.open, None
        item = self._item(o["kind"], o["id"], o["text"])
        at = {"item_id": o["id"], "output_index": len(self.items), "content_index": 0}
        done = ({"type": "response.reasoning_text.done", **at, "text": o["text"]} if o["kind"] == "reasoning" else
                {"type": "response.output_text.done", **at, "text": o["text"], "logprobs": []})
        out = [done, {"type": "response.content_part.done", **at, "part": item["content"][0]},
               {"type": "response.output_item.done", "output_index": len(self.items), "item": item}]
        self.items.append(item)
        return out

    def _events(self, deltas: list[dict]) -> list[dict]:
        """``Answer``'s deltas as events (function calls are sent whole at the end: ``closing``)."""
        out = []
        for d in deltas:
            if d.get("reasoning_content"):
                out += self._delta("reasoning", d["reasoning_content"])
            if d.get("content"):
                out += self._delta("message", d["content"])
        return out

    def piece(self, piece: Piece) -> list[dict]:
        return self._events(self.out.feed(piece.chunk.text))

    def closing(self, stats: Stats) -> list[dict]:
        out = self._events(self.out.finish(cut_by_limit(stats)))
        out += self._close()
        n = len(self.items)
        final = self._finished(self.out.result()[2], stats)
        for i, item in enumerate(self.items[n:], n):
            args = item["arguments"]
            out += [{"type": "response.output_item.added", "output_index": i,
                     "item": {**item, "arguments": "", "status": "in_progress"}},
                    {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": i,
                     "delta": args},
                    {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": i,
                     "name": item["name"], "arguments": args},
                    {"type": "response.output_item.done", "output_index": i, "item": item}]
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [*out, {"type": kind, "response": final}]


def _function_call(call: dict) -> dict:
    """An OpenAI chat tool call (``structured.Answer``) as a ``function_call`` output item."""
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}
