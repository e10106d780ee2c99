"""Tool calls: OpenAI ``tools`` checked, rendered through the model's own template, constrained and parsed.

Two call formats:
  - ``hermes``: the Qwen2.5 / Hermes format, used when the chat template mentions ``<tool_call>``:
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (one block per call);
  - ``json``: any other template: the answer is one ``{"name": ..., "arguments": {...}}`` object.
``tool_choice`` "auto" lets the model choose and parses what it wrote; "required" or a named function
constrains the answer to one call whose arguments follow the function's JSON schema (llguidance's Lark
with an embedded ``%json`` schema); "none" leaves the tools out.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ondevice.constrain import JSON_OPTIONS
from ondevice.errors import OndeviceError

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def check_tools(tools: Any) -> list[dict]:
    """OpenAI ``tools`` ([{"type": "function", "function": {"name", "parameters"?, "description"?}}]), checked.

    Raises:
        OndeviceError: naming the entry and what is wrong.
    """
    if not isinstance(tools, list) or not tools:
        raise OndeviceError("tools must be a non-empty list of {'type': 'function', 'function': {...}} objects")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(fn, Mapping):
            raise OndeviceError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise OndeviceError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise OndeviceError(f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise OndeviceError(f"tools[{i}].function.parameters must be a JSON schema object")
        from ondevice.constrain import json_grammar

        try:
            json_grammar(params)
        except OndeviceError as e:
            raise OndeviceError(f"tools[{i}].function.parameters: {e}") from None
    return list(tools)


def choice_of(tool_choice: Any, tools: Sequence[dict]) -> str:
    """'auto' | 'none' | 'required' | a function's name, from OpenAI's ``tool_choice`` (default 'auto')."""
    if tool_choice is None:
        return "auto"
    if tool_choice in ("auto", "none", "required"):
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise OndeviceError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}")
    if name not in {t["function"]["name"] for t in tools}:
        raise OndeviceError(f"tool_choice names {name!r}, which is not among the tools")
    return name


def call_format(chat_template: str | None) -> str:
    """'hermes' when the template writes ``<tool_call>`` blocks (Qwen2.5, Hermes), else 'json'."""
    return "hermes" if chat_template and HERMES_OPEN in chat_template else "json"


def _call_schema(tools: Sequence[dict], choice: str) -> dict:
    """JSON schema of one call: {"name": const, "arguments": the function's parameters}, any allowed function."""
    options = []
    for t in tools:
        fn = t["function"]
        if choice in ("required", fn["name"]):
            options.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                            "properties": {"name": {"const": fn["name"]},
                                           "arguments": fn.get("parameters") or {"type": "object", "properties": {}}}})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


def call_grammar(tools: Sequence[dict], choice: str, fmt: str) -> str:
    """The Lark grammar (llguidance dialect) of an answer that is one call, for 'required' or a named function."""
    schema = json.dumps(_call_schema(tools, choice))
    if fmt == "hermes":
        return f'start: "{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"\ncall: %json {schema}'
    return f"start: call\ncall: %json {schema}"


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """OpenAI messages as chat templates expect them: an assistant's call arguments as objects, not JSON text,
    and a missing content as an empty string."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass  # a template shows it as text
                calls.append({**c, "function": fn, **fn})  # Qwen's template reads name/arguments at either level
            m["tool_calls"] = calls
        out.append(m)
    return out


def _call(obj: Any, names: set[str]) -> dict | None:
    if not isinstance(obj, Mapping) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _bare_calls(text: str, names: set[str]) -> tuple[int, list[dict]] | None:
    """(where they start, the calls) when ``text`` ends with one or more whitespace-separated call objects."""
    dec = json.JSONDecoder()
    for start in [i for i, ch in enumerate(text) if ch == "{" and (i == 0 or text[i - 1] in "\n")]:
        calls, i = [], start
        try:
            while i < len(text):
                obj, i = dec.raw_decode(text, i)
                call = _call(obj, names)
                if call is None:
                    break
                calls.append(call)
                while i < len(text) and text[i].isspace():
                    i += 1
        except json.JSONDecodeError:
            continue
        if calls and i >= len(text):
            return start, calls
    return None


def split_calls(text: str, fmt: str, tools: Sequence[dict]) -> tuple[str, list[dict], str]:
    """(text before the calls, the calls, text after them); no calls: (text, [], "").

    Hermes blocks are found by their tags; a template whose tags are special tokens (Qwen2.5's ``<tool_call>``
    is one, and special tokens render as nothing) leaves bare call objects at the end of the answer, which
    are recognised as well, as are bare objects for the 'json' format. Calls to unknown functions stay text.
    """
    names = {t["function"]["name"] for t in tools}
    if fmt == "hermes":
        calls, spans = [], []
        for m in _HERMES.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), names)
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
                spans.append(m.span())
        if calls:
            return text[: spans[0][0]], calls, "".join(text[b : a2] for (_, b), (a2, _) in zip(spans, [*spans[1:], (len(text), 0)], strict=True))
    found = _bare_calls(text, names)
    if found is None:
        return text, [], ""
    return text[: found[0]], found[1], ""


def parse_calls(text: str, fmt: str, tools: Sequence[dict]) -> tuple[str | None, list[dict]]:
    """Split a model's answer into (content, OpenAI ``tool_calls``); see ``split_calls``.

    Returns:
        (the text outside the calls, stripped, or None when empty; the calls, in order).
    """
    before, calls, after = split_calls(text, fmt, tools)
    return ((before + after).strip() or None), calls


def held_back(text: str, fmt: str) -> int:
    """Where streamed content must stop: the start of what may be a tool call (a ``<tool_call>`` tag, even a
    partial one, or a ``{`` opening a line, as a call whose tags are special tokens shows)."""
    ends = [len(text)]
    i = text.find(HERMES_OPEN)
    if fmt == "hermes" and i >= 0:
        ends.append(i)
    if fmt == "hermes":
        for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
            if text.endswith(HERMES_OPEN[:k]):
                ends.append(len(text) - k)
                break
    j = 0 if text.startswith("{") else text.find("\n{")
    if j >= 0:
        ends.append(j + (0 if text.startswith("{") else 1))
    return min(ends)
